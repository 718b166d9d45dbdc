//! iptables rules as values: what render.rs makes, the proxier writes and
//! nft/encode.rs turns into netlink. Their text is their `Display`: the
//! iptables-restore input the iptables programs take, dry runs print and
//! docs/iptables.md shows, upstream kube-proxy's text option for option.
//! A rule keeps its options in the order that text gives them; the encoder
//! puts them in the order iptables holds them.

use std::fmt::{self, Display, Formatter};
use std::net::SocketAddr;

use ipnet::IpNet;
use kp_model::Protocol;
use kp_xtables::Jump;

/// One line of iptables-restore input, borrowing its chain and rule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Line<'a> {
    /// `*table`
    Table(&'a str),
    /// `:CHAIN - [0:0]`: create the chain, or flush it when it exists.
    Chain(&'a str),
    /// `-A CHAIN rule`
    Append(&'a str, &'a Rule),
    /// `-I CHAIN 1 rule`
    Insert(&'a str, &'a Rule),
    /// `-X CHAIN`
    DeleteChain(&'a str),
    /// `COMMIT`
    Commit,
}

/// An iptables-restore input: its lines in order (line `n` of the text is
/// `lines[n - 1]`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Restore<'a> {
    pub lines: Vec<Line<'a>>,
}

/// A rule: its matches in the order of its text, then its target.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Rule {
    pub matches: Vec<Match>,
    pub target: Target,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Iface {
    pub negate: bool,
    /// Without the trailing `+` of a prefix match.
    pub name: String,
    pub prefix: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Addr {
    pub negate: bool,
    /// As configured: iptables clears the host bits itself.
    pub net: IpNet,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Match {
    /// `[!] -s NET`
    Src(Addr),
    /// `[!] -d NET`
    Dst(Addr),
    /// `[!] -i NAME[+]`
    In(Iface),
    /// `-m comment --comment "TEXT"`; made by [`Match::comment`].
    Comment(String),
    /// `-m P -p P [-d DST] [--dport N]`: the protocol's match, the protocol,
    /// and the destination written between them as upstream does.
    Ports {
        proto: Protocol,
        dst: Option<Addr>,
        dport: Option<u16>,
    },
    /// `-m statistic --mode random --probability P`, P being 1/`one_in` as
    /// upstream writes it ([`probability`]).
    Random {
        one_in: u32,
    },
    Recent(Recent),
    /// `-m addrtype --src-type LOCAL` (`src`) or `--dst-type LOCAL`.
    Local {
        src: bool,
    },
    /// `-m conntrack [!] --ctstate S,...`, the states as [`CT_NEW`] etc.
    CtState {
        negate: bool,
        states: u16,
    },
    /// `-m mark [!] --mark V/M`
    Mark {
        negate: bool,
        value: u32,
        mask: u32,
    },
    /// `-m nfacct --nfacct-name NAME`: counts into that nfacct object.
    Nfacct(&'static str),
}

/// `-m recent`, on the source address.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Recent {
    /// `--name NAME --set`: the source is added to the list.
    Set { name: String },
    /// `--name NAME --rcheck --seconds S --reap`: the source was seen in the
    /// last S seconds; older entries go.
    Check { name: String, seconds: u32 },
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Target {
    /// No `-j`: the rule only counts.
    None,
    Accept,
    Drop,
    Return,
    /// `-j REJECT` with its default (port unreachable).
    Reject,
    /// `-j CHAIN`
    Jump(String),
    /// `-j DNAT --to-destination ADDR:PORT`
    Dnat(SocketAddr),
    /// `-j MASQUERADE --random-fully`
    MasqueradeRandomFully,
    /// `-j MARK --or-mark M`
    MarkOr(u32),
    /// `-j MARK --xor-mark M`
    MarkXor(u32),
}

/// xt_conntrack's state bits, as `--ctstate` names them.
pub const CT_INVALID: u16 = 1;
pub const CT_ESTABLISHED: u16 = 1 << 1;
pub const CT_RELATED: u16 = 1 << 2;
pub const CT_NEW: u16 = 1 << 3;
/// 1 << (IP_CT_NUMBER + 2), IP_CT_NUMBER being 5.
pub const CT_DNAT: u16 = 1 << 7;

/// Each state with its name, in the order upstream's text lists them.
const CT_NAMES: [(u16, &str); 5] = [
    (CT_INVALID, "INVALID"),
    (CT_NEW, "NEW"),
    (CT_RELATED, "RELATED"),
    (CT_ESTABLISHED, "ESTABLISHED"),
    (CT_DNAT, "DNAT"),
];

/// Upstream's probability text for 1/n (`%0.10f`).
pub fn probability(n: usize) -> String {
    format!("{:.10}", 1.0 / n as f64)
}

impl Match {
    /// A comment. Names reaching here are validated DNS labels; anything
    /// that could end the quoted string or the line is dropped anyway.
    pub fn comment(text: impl Into<String>) -> Match {
        let text = text.into();
        let ok = |c: &char| (c.is_ascii_graphic() || *c == ' ') && !matches!(c, '"' | '\\');
        if text.len() <= 240 && text.chars().all(|c| ok(&c)) {
            return Match::Comment(text);
        }
        Match::Comment(text.chars().filter(ok).take(240).collect())
    }

    /// `-s` of one address.
    pub fn src_host(ip: std::net::IpAddr) -> Match {
        Match::Src(Addr::new(false, IpNet::from(ip)))
    }
}

impl Addr {
    pub fn new(negate: bool, net: IpNet) -> Addr {
        Addr { negate, net }
    }
}

impl Rule {
    pub fn new(matches: Vec<Match>, target: Target) -> Rule {
        Rule { matches, target }
    }

    /// The rule of a jump from a builtin chain into ours.
    pub fn jump(j: &Jump) -> Rule {
        let mut m = Vec::with_capacity(2);
        if j.new_only {
            m.push(Match::CtState {
                negate: false,
                states: CT_NEW,
            });
        }
        m.push(Match::comment(j.comment));
        Rule::new(m, Target::Jump(j.to.to_string()))
    }

    /// The `-p` protocol of its port match, if it has one.
    pub fn proto(&self) -> Option<Protocol> {
        self.matches.iter().find_map(|m| match m {
            Match::Ports { proto, .. } => Some(*proto),
            _ => None,
        })
    }
}

impl<'a> Restore<'a> {
    pub fn push(&mut self, line: Line<'a>) {
        self.lines.push(line);
    }

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// The input's text, in one allocation: a full sync's is ~50 MB at 10k
    /// Services (~110 bytes a line), and grown by doubling it cost 0.2-0.4 s,
    /// most of it the kernel zeroing fresh pages for each larger copy.
    pub fn text(&self) -> String {
        use std::fmt::Write;
        let mut text = String::with_capacity(self.lines.len() * 128);
        let _ = write!(text, "{self}");
        text
    }
}

fn not(f: &mut Formatter<'_>, negate: bool) -> fmt::Result {
    if negate {
        f.write_str("! ")?;
    }
    Ok(())
}

impl Display for Addr {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        self.net.fmt(f)
    }
}

impl Display for Match {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match self {
            Match::Src(a) => {
                not(f, a.negate)?;
                write!(f, "-s {a}")
            }
            Match::Dst(a) => {
                not(f, a.negate)?;
                write!(f, "-d {a}")
            }
            Match::In(i) => {
                not(f, i.negate)?;
                write!(f, "-i {}{}", i.name, if i.prefix { "+" } else { "" })
            }
            Match::Comment(c) => write!(f, "-m comment --comment \"{c}\""),
            Match::Ports { proto, dst, dport } => {
                let p = proto.as_lower();
                write!(f, "-m {p} -p {p}")?;
                if let Some(d) = dst {
                    f.write_str(" ")?;
                    Match::Dst(*d).fmt(f)?;
                }
                if let Some(port) = dport {
                    write!(f, " --dport {port}")?;
                }
                Ok(())
            }
            Match::Random { one_in } => write!(
                f,
                "-m statistic --mode random --probability {}",
                probability(*one_in as usize)
            ),
            Match::Recent(Recent::Set { name }) => write!(f, "-m recent --name {name} --set"),
            Match::Recent(Recent::Check { name, seconds }) => write!(
                f,
                "-m recent --name {name} --rcheck --seconds {seconds} --reap"
            ),
            Match::Local { src } => write!(
                f,
                "-m addrtype --{}-type LOCAL",
                if *src { "src" } else { "dst" }
            ),
            Match::CtState { negate, states } => {
                f.write_str("-m conntrack ")?;
                not(f, *negate)?;
                f.write_str("--ctstate ")?;
                let mut first = true;
                for (_, name) in CT_NAMES.iter().filter(|(bit, _)| states & bit != 0) {
                    if !first {
                        f.write_str(",")?;
                    }
                    f.write_str(name)?;
                    first = false;
                }
                Ok(())
            }
            Match::Mark {
                negate,
                value,
                mask,
            } => {
                f.write_str("-m mark ")?;
                not(f, *negate)?;
                write!(f, "--mark 0x{value:x}/0x{mask:x}")
            }
            Match::Nfacct(name) => write!(f, "-m nfacct --nfacct-name {name}"),
        }
    }
}

impl Display for Target {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match self {
            Target::None => Ok(()),
            Target::Accept => f.write_str("-j ACCEPT"),
            Target::Drop => f.write_str("-j DROP"),
            Target::Return => f.write_str("-j RETURN"),
            Target::Reject => f.write_str("-j REJECT"),
            Target::Jump(c) => write!(f, "-j {c}"),
            Target::Dnat(a) => write!(f, "-j DNAT --to-destination {a}"),
            Target::MasqueradeRandomFully => f.write_str("-j MASQUERADE --random-fully"),
            Target::MarkOr(m) => write!(f, "-j MARK --or-mark 0x{m:x}"),
            Target::MarkXor(m) => write!(f, "-j MARK --xor-mark 0x{m:x}"),
        }
    }
}

impl Display for Rule {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        let mut sep = "";
        for m in &self.matches {
            write!(f, "{sep}{m}")?;
            sep = " ";
        }
        if self.target != Target::None {
            write!(f, "{sep}{}", self.target)?;
        }
        Ok(())
    }
}

impl Display for Line<'_> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        match self {
            Line::Table(t) => write!(f, "*{t}"),
            Line::Chain(c) => write!(f, ":{c} - [0:0]"),
            Line::Append(c, r) => write!(f, "-A {c} {r}"),
            Line::Insert(c, r) => write!(f, "-I {c} 1 {r}"),
            Line::DeleteChain(c) => write!(f, "-X {c}"),
            Line::Commit => f.write_str("COMMIT"),
        }
    }
}

impl Display for Restore<'_> {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        for l in &self.lines {
            writeln!(f, "{l}")?;
        }
        Ok(())
    }
}
