//! iptables-restore input as typed operations and rules: exactly the options
//! render.rs emits (the proxier's own text, never an operator's), each kept
//! as iptables itself would hold it after parsing, so that encode.rs can
//! write what iptables-nft writes.

use std::borrow::Cow;
use std::net::IpAddr;

use ipnet::IpNet;

/// One line of iptables-restore input that does something.
#[derive(Debug, Clone, PartialEq)]
pub enum Line {
    /// `*table`
    Table(String),
    /// `:CHAIN - [0:0]`: create the chain, or flush it when it exists.
    Chain(String),
    /// `-A CHAIN rule`
    Append(String, Rule),
    /// `-I CHAIN 1 rule`
    Insert(String, Rule),
    /// `-X CHAIN`
    DeleteChain(String),
    /// `COMMIT`
    Commit,
}

/// A rule as iptables parses it: the fixed fields of `struct ipt_ip`, then
/// matches in their order, then the target.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Rule {
    pub in_iface: Option<Iface>,
    pub out_iface: Option<Iface>,
    /// `-p`: an IP protocol number.
    pub proto: Option<u8>,
    pub src: Option<Addr>,
    pub dst: Option<Addr>,
    pub matches: Vec<Match>,
    pub target: Target,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Iface {
    pub negate: bool,
    /// Without the trailing `+` of a prefix match.
    pub name: String,
    pub prefix: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Addr {
    pub negate: bool,
    /// Host bits cleared, as iptables stores it.
    pub net: IpNet,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Match {
    Comment(String),
    /// `-m tcp|udp|sctp [--dport N]`: the protocol number and the port.
    Ports {
        proto: u8,
        dport: Option<u16>,
    },
    /// `-m statistic --mode random --probability P`: P scaled to 2^31.
    Random {
        probability: u32,
    },
    Recent(Recent),
    /// `-m addrtype`: (negate, RTN type bit mask) for source and destination.
    AddrType {
        src: Option<(bool, u16)>,
        dst: Option<(bool, u16)>,
    },
    /// `-m conntrack [!] --ctstate S,...` as xt_conntrack's state bits.
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
    Nfacct(String),
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Recent {
    pub name: String,
    /// xt_recent's check_set bits (XT_RECENT_CHECK, SET, REAP, ...).
    pub flags: u8,
    pub seconds: u32,
}

pub const RECENT_CHECK: u8 = 1;
pub const RECENT_SET: u8 = 2;
pub const RECENT_REAP: u8 = 32;

#[derive(Debug, Clone, PartialEq, Default)]
pub enum Target {
    /// No `-j`: the rule only counts.
    #[default]
    None,
    Accept,
    Drop,
    Return,
    Jump(String),
    /// `-j REJECT` with its default (port unreachable).
    Reject,
    /// `-j DNAT --to-destination ADDR[:PORT]`
    Dnat {
        addr: IpAddr,
        port: Option<u16>,
    },
    /// `-j MASQUERADE [--random-fully]`
    Masquerade {
        random_fully: bool,
    },
    /// `-j MARK`: xt_MARK's (mark, mask): the new mark is (old & !mask) ^ mark.
    Mark {
        mark: u32,
        mask: u32,
    },
}

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
pub const IPPROTO_SCTP: u8 = 132;

/// `RTN_LOCAL` as an xt_addrtype bit.
const ADDRTYPE_LOCAL: u16 = 1 << 2;

/// Splits a rule's text into arguments as a shell would for iptables: words,
/// with double-quoted strings (our comments) kept whole. Words borrow from
/// `text` (a full sync parses ~50 words a rule, 480k rules at 10k Services:
/// a String each was most of the parse); only a word with a quote inside it
/// (`a"b c"`) is put together.
pub fn split_args(text: &str) -> Result<Vec<Cow<'_, str>>, String> {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(32);
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_whitespace() {
            i += 1;
            continue;
        }
        // One word: up to whitespace outside quotes.
        let start = i;
        let mut quotes = 0;
        let mut quoted = false;
        while i < b.len() && (quoted || !b[i].is_ascii_whitespace()) {
            if b[i] == b'"' {
                quoted = !quoted;
                quotes += 1;
            }
            i += 1;
        }
        if quoted {
            return Err("unterminated quote".into());
        }
        let word = &text[start..i];
        out.push(match quotes {
            0 => Cow::Borrowed(word),
            // `"..."` as a whole word: what is inside.
            2 if word.len() >= 2 && word.starts_with('"') && word.ends_with('"') => {
                Cow::Borrowed(&word[1..word.len() - 1])
            }
            _ => Cow::Owned(word.chars().filter(|&c| c != '"').collect()),
        });
    }
    Ok(out)
}

/// Parses iptables-restore input line by line, lazily (a full sync's input
/// is tens of MB: its lines are encoded as they are read, never all held).
/// Blank lines and comments are skipped; anything render.rs does not emit is
/// an error naming the line.
pub fn restore_lines(input: &str) -> impl Iterator<Item = Result<(usize, Line), String>> + '_ {
    input
        .lines()
        .enumerate()
        .filter_map(|(i, raw)| restore_line(i + 1, raw))
}

/// Line `n` of a restore input, `raw`: None for a blank line or a comment.
pub fn restore_line(n: usize, raw: &str) -> Option<Result<(usize, Line), String>> {
    let l = raw.trim();
    if l.is_empty() || l.starts_with('#') {
        return None;
    }
    Some(
        parse_line(l)
            .map(|line| (n, line))
            .map_err(|e| format!("line {n}: {e}: `{l}`")),
    )
}

fn parse_line(l: &str) -> Result<Line, String> {
    if let Some(t) = l.strip_prefix('*') {
        return Ok(Line::Table(t.to_string()));
    }
    if l == "COMMIT" {
        return Ok(Line::Commit);
    }
    if let Some(rest) = l.strip_prefix(':') {
        let mut w = rest.split_whitespace();
        let name = w.next().ok_or("chain without a name")?;
        return match w.next() {
            Some("-") => Ok(Line::Chain(name.to_string())),
            _ => Err("only user chains (policy `-`) can be declared".into()),
        };
    }
    let args = split_args(l)?;
    match args.first().map(|a| a.as_ref()) {
        Some("-A") => {
            let chain = args.get(1).ok_or("-A without a chain")?;
            Ok(Line::Append(chain.to_string(), parse_rule(&args[2..])?))
        }
        Some("-I") => {
            let chain = args.get(1).ok_or("-I without a chain")?;
            if args.get(2).map(|a| a.as_ref()) != Some("1") {
                return Err("only `-I CHAIN 1` is supported".into());
            }
            Ok(Line::Insert(chain.to_string(), parse_rule(&args[3..])?))
        }
        Some("-X") => {
            let chain = args.get(1).ok_or("-X without a chain")?;
            Ok(Line::DeleteChain(chain.to_string()))
        }
        _ => Err("unsupported command".into()),
    }
}

fn parse_u32(s: &str) -> Result<u32, String> {
    let r = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(h) => u32::from_str_radix(h, 16),
        None => s.parse(),
    };
    r.map_err(|_| format!("bad number {s:?}"))
}

fn parse_addr(s: &str) -> Result<IpNet, String> {
    let net = match s.parse::<IpNet>() {
        Ok(n) => n,
        Err(_) => IpNet::from(
            s.parse::<IpAddr>()
                .map_err(|_| format!("bad address {s:?}"))?,
        ),
    };
    Ok(net.trunc())
}

fn parse_iface(s: &str, negate: bool) -> Iface {
    match s.strip_suffix('+') {
        Some(p) => Iface {
            negate,
            name: p.to_string(),
            prefix: true,
        },
        None => Iface {
            negate,
            name: s.to_string(),
            prefix: false,
        },
    }
}

fn proto_number(s: &str) -> Result<u8, String> {
    match s {
        "tcp" => Ok(IPPROTO_TCP),
        "udp" => Ok(IPPROTO_UDP),
        "sctp" => Ok(IPPROTO_SCTP),
        _ => Err(format!("unsupported protocol {s:?}")),
    }
}

fn ct_states(s: &str) -> Result<u16, String> {
    let mut bits = 0u16;
    for st in s.split(',') {
        bits |= match st {
            "INVALID" => 1,
            "ESTABLISHED" => 1 << 1,
            "RELATED" => 1 << 2,
            "NEW" => 1 << 3,
            // 1 << (IP_CT_NUMBER + 1...3), IP_CT_NUMBER being 5.
            "SNAT" => 1 << 6,
            "DNAT" => 1 << 7,
            "UNTRACKED" => 1 << 8,
            _ => return Err(format!("unsupported conntrack state {st:?}")),
        };
    }
    Ok(bits)
}

fn addr_type(s: &str) -> Result<u16, String> {
    match s {
        "LOCAL" => Ok(ADDRTYPE_LOCAL),
        _ => Err(format!("unsupported address type {s:?}")),
    }
}

/// `--to-destination 10.0.0.5:8080` or `[fd00::5]:8080` (or without a port).
fn parse_nat_dest(s: &str) -> Result<(IpAddr, Option<u16>), String> {
    let bad = || format!("bad --to-destination {s:?}");
    if let Some(rest) = s.strip_prefix('[') {
        let (ip, port) = rest.split_once(']').ok_or_else(bad)?;
        let ip: IpAddr = ip.parse().map_err(|_| bad())?;
        let port = match port.strip_prefix(':') {
            Some(p) => Some(p.parse().map_err(|_| bad())?),
            None if port.is_empty() => None,
            None => return Err(bad()),
        };
        return Ok((ip, port));
    }
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok((ip, None));
    }
    let (ip, port) = s.rsplit_once(':').ok_or_else(bad)?;
    Ok((
        ip.parse().map_err(|_| bad())?,
        Some(port.parse().map_err(|_| bad())?),
    ))
}

/// Parses one rule's arguments (after `-A CHAIN`).
pub fn parse_rule<S: AsRef<str>>(args: &[S]) -> Result<Rule, String> {
    let mut r = Rule::default();
    let mut has_target = false;
    let mut negate = false;
    let mut it = args.iter().map(AsRef::as_ref);
    fn value<'a>(it: &mut dyn Iterator<Item = &'a str>, opt: &str) -> Result<&'a str, String> {
        it.next().ok_or_else(|| format!("{opt} needs a value"))
    }
    while let Some(a) = it.next() {
        if a == "!" {
            if negate {
                return Err("`!` twice".into());
            }
            negate = true;
            continue;
        }
        let neg = std::mem::take(&mut negate);
        let no_neg = |ok: bool| {
            if neg && !ok {
                Err(format!("`!` is not supported before {a}"))
            } else {
                Ok(())
            }
        };
        match a {
            "-p" => {
                no_neg(false)?;
                r.proto = Some(proto_number(value(&mut it, a)?)?);
            }
            "-s" | "-d" => {
                let net = parse_addr(value(&mut it, a)?)?;
                let addr = Addr { negate: neg, net };
                if a == "-s" {
                    r.src = Some(addr);
                } else {
                    r.dst = Some(addr);
                }
            }
            "-i" => r.in_iface = Some(parse_iface(value(&mut it, a)?, neg)),
            "-o" => r.out_iface = Some(parse_iface(value(&mut it, a)?, neg)),
            "-m" => {
                no_neg(false)?;
                let name = value(&mut it, a)?;
                r.matches.push(match name {
                    "comment" => Match::Comment(String::new()),
                    "tcp" | "udp" | "sctp" => Match::Ports {
                        proto: proto_number(name)?,
                        dport: None,
                    },
                    "statistic" => Match::Random { probability: 0 },
                    "recent" => Match::Recent(Recent::default()),
                    "addrtype" => Match::AddrType {
                        src: None,
                        dst: None,
                    },
                    "conntrack" => Match::CtState {
                        negate: false,
                        states: 0,
                    },
                    "mark" => Match::Mark {
                        negate: false,
                        value: 0,
                        mask: u32::MAX,
                    },
                    "nfacct" => Match::Nfacct(String::new()),
                    other => return Err(format!("unsupported match {other:?}")),
                });
            }
            "-j" => {
                no_neg(false)?;
                let t = value(&mut it, a)?;
                r.target = match t {
                    "ACCEPT" => Target::Accept,
                    "DROP" => Target::Drop,
                    "RETURN" => Target::Return,
                    "REJECT" => Target::Reject,
                    "DNAT" => Target::Dnat {
                        addr: IpAddr::from([0, 0, 0, 0]),
                        port: None,
                    },
                    "MASQUERADE" => Target::Masquerade {
                        random_fully: false,
                    },
                    "MARK" => Target::Mark { mark: 0, mask: 0 },
                    chain if chain.starts_with("KUBE-") => Target::Jump(chain.to_string()),
                    other => return Err(format!("unsupported target {other:?}")),
                };
                has_target = true;
            }
            opt if opt.starts_with("--") && has_target => {
                no_neg(false)?;
                target_option(&mut r.target, opt, &mut it)?;
            }
            opt if opt.starts_with("--") => {
                match_option(&mut r.matches, opt, neg, &mut it)?;
            }
            other => return Err(format!("unsupported argument {other:?}")),
        }
    }
    if negate {
        return Err("`!` at the end".into());
    }
    if let Target::Dnat { addr, .. } = &r.target {
        if addr.is_unspecified() {
            return Err("DNAT without --to-destination".into());
        }
    }
    Ok(r)
}

fn target_option(
    t: &mut Target,
    opt: &str,
    it: &mut dyn Iterator<Item = &str>,
) -> Result<(), String> {
    let mut val = || it.next().ok_or_else(|| format!("{opt} needs a value"));
    match (t, opt) {
        (Target::Dnat { addr, port }, "--to-destination") => {
            (*addr, *port) = parse_nat_dest(val()?)?;
        }
        (Target::Masquerade { random_fully }, "--random-fully") => *random_fully = true,
        (Target::Mark { mark, mask }, "--xor-mark") => {
            *mark = parse_u32(val()?)?;
            *mask = 0;
        }
        (Target::Mark { mark, mask }, "--or-mark") => {
            let v = parse_u32(val()?)?;
            (*mark, *mask) = (v, v);
        }
        (_, o) => return Err(format!("unsupported target option {o}")),
    }
    Ok(())
}

/// Gives `opt` to the last match that takes it, as iptables does.
fn match_option(
    matches: &mut [Match],
    opt: &str,
    neg: bool,
    it: &mut dyn Iterator<Item = &str>,
) -> Result<(), String> {
    let takes = |m: &Match| {
        matches!(
            (m, opt),
            (Match::Comment(_), "--comment")
                | (Match::Ports { .. }, "--dport")
                | (Match::Random { .. }, "--mode" | "--probability")
                | (
                    Match::Recent(_),
                    "--name" | "--set" | "--rcheck" | "--seconds" | "--reap"
                )
                | (Match::AddrType { .. }, "--src-type" | "--dst-type")
                | (Match::CtState { .. }, "--ctstate")
                | (Match::Mark { .. }, "--mark")
                | (Match::Nfacct(_), "--nfacct-name")
        )
    };
    let m = matches
        .iter_mut()
        .rev()
        .find(|m| takes(m))
        .ok_or_else(|| format!("option {opt} without a match that takes it"))?;
    let mut val = || it.next().ok_or_else(|| format!("{opt} needs a value"));
    let neg_ok = matches!(opt, "--ctstate" | "--mark" | "--src-type" | "--dst-type");
    if neg && !neg_ok {
        return Err(format!("`!` is not supported before {opt}"));
    }
    match m {
        Match::Comment(c) => *c = val()?.to_string(),
        Match::Nfacct(n) => *n = val()?.to_string(),
        Match::Ports { dport, .. } => {
            *dport = Some(val()?.parse().map_err(|_| format!("bad port for {opt}"))?)
        }
        Match::Random { probability } => {
            let v = val()?;
            if opt == "--mode" {
                if v != "random" {
                    return Err(format!("unsupported statistic mode {v:?}"));
                }
            } else {
                let p: f64 = v.parse().map_err(|_| format!("bad probability {v:?}"))?;
                if !(0.0..=1.0).contains(&p) {
                    return Err(format!("probability {v} out of range"));
                }
                // libxt_statistic: lround(0x80000000 * p).
                *probability = (p * 2_147_483_648.0).round() as u32;
            }
        }
        Match::Recent(rc) => match opt {
            "--name" => rc.name = val()?.to_string(),
            "--set" => rc.flags |= RECENT_SET,
            "--rcheck" => rc.flags |= RECENT_CHECK,
            "--reap" => rc.flags |= RECENT_REAP,
            _ => {
                let v = val()?;
                rc.seconds = v.parse().map_err(|_| format!("bad --seconds {v:?}"))?;
            }
        },
        Match::AddrType { src, dst } => {
            let t = (neg, addr_type(val()?)?);
            if opt == "--src-type" {
                *src = Some(t);
            } else {
                *dst = Some(t);
            }
        }
        Match::CtState { negate, states } => {
            *negate = neg;
            *states = ct_states(val()?)?;
        }
        Match::Mark {
            negate,
            value,
            mask,
        } => {
            *negate = neg;
            let v = val()?;
            match v.split_once('/') {
                Some((a, b)) => {
                    *value = parse_u32(a)?;
                    *mask = parse_u32(b)?;
                }
                None => *value = parse_u32(v)?,
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(text: &str) -> Rule {
        parse_rule(&split_args(text).unwrap()).unwrap()
    }

    #[test]
    fn words_split_as_a_shell_splits_them() {
        let words = |t: &str| -> Vec<String> {
            split_args(t)
                .unwrap()
                .into_iter()
                .map(|w| w.into_owned())
                .collect()
        };
        assert_eq!(
            words("  -A\tKUBE-X  -m comment --comment \"ns/a b:p\" -j DROP "),
            [
                "-A",
                "KUBE-X",
                "-m",
                "comment",
                "--comment",
                "ns/a b:p",
                "-j",
                "DROP"
            ]
        );
        assert_eq!(words("--comment \"\" x"), ["--comment", "", "x"]);
        assert_eq!(words("a\"b c\"d e"), ["ab cd", "e"]);
        assert_eq!(words("\"a\"\"b c\""), ["ab c"]);
        assert!(words("").is_empty());
        // Whole words and whole quoted words borrow from the line.
        assert!(split_args("-j \"KUBE-X\"")
            .unwrap()
            .iter()
            .all(|w| matches!(w, Cow::Borrowed(_))));
        assert!(split_args("x \"open").is_err());
    }

    #[test]
    fn a_cluster_ip_rule_keeps_every_part() {
        let r = rule(
            "-m comment --comment \"ns/svc:p cluster IP\" -m tcp -p tcp -d 10.96.0.1/32 --dport 80 ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ",
        );
        assert_eq!(r.proto, Some(IPPROTO_TCP));
        assert_eq!(
            r.matches,
            vec![
                Match::Comment("ns/svc:p cluster IP".into()),
                Match::Ports {
                    proto: IPPROTO_TCP,
                    dport: Some(80)
                }
            ]
        );
        assert_eq!(
            r.dst.as_ref().map(|a| a.net.to_string()).as_deref(),
            Some("10.96.0.1/32")
        );
        assert!(r.src.as_ref().is_some_and(|a| a.negate));
        assert_eq!(r.target, Target::Jump("KUBE-MARK-MASQ".into()));
    }

    #[test]
    fn targets_and_their_options() {
        assert_eq!(
            rule("-j DNAT --to-destination [fd00::5]:8080").target,
            Target::Dnat {
                addr: "fd00::5".parse().unwrap(),
                port: Some(8080)
            }
        );
        assert_eq!(
            rule("-j MARK --or-mark 0x4000").target,
            Target::Mark {
                mark: 0x4000,
                mask: 0x4000
            }
        );
        assert_eq!(
            rule("-j MARK --xor-mark 0x4000").target,
            Target::Mark {
                mark: 0x4000,
                mask: 0
            }
        );
        let r = rule("-m statistic --mode random --probability 0.3333333333 -j KUBE-SEP-X");
        assert_eq!(
            r.matches,
            vec![Match::Random {
                probability: 715_827_883
            }]
        );
        let r = rule("-m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP");
        assert_eq!(
            r.matches,
            vec![Match::CtState {
                negate: true,
                states: 0x86
            }]
        );
    }

    #[test]
    fn what_render_does_not_emit_is_refused_with_the_reason() {
        for (text, why) in [
            ("-m limit --limit 5/s -j ACCEPT", "unsupported match"),
            ("-j LOG", "unsupported target"),
            ("! -p tcp -j DROP", "`!` is not supported"),
            ("--dport 80 -j DROP", "without a match"),
            ("-j DNAT", "without --to-destination"),
            ("-m comment --comment \"open", "unterminated"),
        ] {
            let e = split_args(text)
                .and_then(|a| parse_rule(&a))
                .expect_err(text);
            assert!(e.contains(why), "{text}: {e}");
        }
        let e = restore_lines("*nat\n:INPUT ACCEPT [0:0]\n")
            .collect::<Result<Vec<_>, _>>()
            .unwrap_err();
        assert!(e.starts_with("line 2:"), "{e}");
    }
}
