//! nf_tables over netlink: the proxier's typed transactions encoded as one
//! batch of nf_tables messages, without the `nft` program (whose cost grows
//! faster than linearly with the number of chains) and without nft text.

mod batch;
mod expr;
mod readback;

use kp_model::{DataplaneError, IpFamily, RefusedOp};
use kp_netlink::nftables::{
    errno_text, msg, next_seq, nft_type, refusals, ExchangeError, NftSocket, Refusal,
};
use kp_netlink::{Attrs, ParsedAttrs, Reply, Until, NLM_F_ACK, NLM_F_DUMP};

use crate::backend::{shorten, NftBackend};
use crate::types::{ElemKey, Transaction};
use crate::view::TableView;

pub use batch::EncodeError;

const TOOL: &str = "nf_tables netlink";

/// Sends nft transactions to the kernel as one nf_tables netlink batch, over
/// one kept socket (kp_netlink's [`NftSocket`]).
#[derive(Debug, Default)]
pub struct NftNetlink {
    sock: NftSocket,
}

impl NftNetlink {
    pub fn new() -> Self {
        NftNetlink::default()
    }

    /// Checks that every object of `tx` can be encoded (addresses of the
    /// table's family, interface names and comments that fit), without
    /// touching the kernel.
    pub fn check(tx: &Transaction) -> Result<(), EncodeError> {
        batch::encode(tx, 1).map(|_| ())
    }

    /// `tx` as the netlink batch [`NftBackend::apply`] would send, for
    /// benchmarks that time the kernel alone on exactly these bytes.
    pub fn encode(tx: &Transaction) -> Result<kp_netlink::nftables::Batch, EncodeError> {
        let seq0 = next_seq(batch::max_messages(tx));
        batch::encode(tx, seq0).map(|b| b.inner)
    }
}

fn io_err(e: ExchangeError, what: &str) -> DataplaneError {
    DataplaneError::Io {
        what: format!("{what}: {}", e.step),
        source: e.source,
    }
}

impl NftNetlink {
    /// Sends one nf_tables request and returns the data messages of its
    /// answer, or the kernel's errno.
    fn query(
        &mut self,
        family: IpFamily,
        ty: u16,
        flags: u16,
        attrs: &Attrs,
        what: &str,
        until: Until,
    ) -> Result<Result<Vec<Reply>, i32>, DataplaneError> {
        let fam = expr::Family::from(family);
        self.sock
            .query(fam.nfproto(), ty, flags, attrs, until)
            .map_err(|e| io_err(e, &format!("asking the kernel for {what}")))
    }
}

impl NftNetlink {
    /// A request's answer: a dump, or one object's (acknowledged); None
    /// when the object asked about is not there (ENOENT). `what` names it
    /// in I/O errors, `doing` in the kernel's refusals.
    fn ask(
        &mut self,
        family: IpFamily,
        ty: u16,
        dump: bool,
        attrs: &Attrs,
        what: &str,
        doing: &str,
    ) -> Result<Option<Vec<Reply>>, DataplaneError> {
        let (flags, until) = if dump {
            (NLM_F_DUMP, Until::Done)
        } else {
            (NLM_F_ACK, Until::Ack)
        };
        match self.query(family, ty, flags, attrs, what, until)? {
            Ok(r) => Ok(Some(r)),
            Err(libc::ENOENT) => Ok(None),
            Err(errno) => Err(DataplaneError::Apply {
                tool: TOOL.into(),
                message: format!("{doing}: {}", errno_text(errno)),
            }),
        }
    }

    /// A dump request's answer, as [`Self::ask`] gives it.
    fn dump(
        &mut self,
        family: IpFamily,
        ty: u16,
        attrs: &Attrs,
        what: &str,
        doing: &str,
    ) -> Result<Option<Vec<Reply>>, DataplaneError> {
        self.ask(family, ty, true, attrs, what, doing)
    }

    /// Our table's description (NEWTABLE); None when it is not there.
    fn get_table(
        &mut self,
        family: IpFamily,
        table: &str,
    ) -> Result<Option<Vec<Reply>>, DataplaneError> {
        let mut a = Attrs::new();
        a.str(1, table);
        self.ask(
            family,
            msg::GETTABLE,
            false,
            &a,
            "the nftables table",
            &format!("getting table {table}"),
        )
    }

    /// Sends an encoded batch; `text` gives a refused line's text, if kept.
    fn send(
        &mut self,
        batch: batch::Batch,
        text: &dyn Fn(usize) -> Option<String>,
    ) -> Result<usize, DataplaneError> {
        if batch.is_empty() {
            return Ok(0);
        }
        let answers = self
            .sock
            .send_batch(&batch.inner)
            .map_err(|e| io_err(e, TOOL))?;
        let mut refused = Vec::new();
        let mut errors = Vec::new();
        for r in refusals(&batch.inner, &answers) {
            match r {
                Refusal::Op(line, errno) => refused.push(RefusedOp {
                    line,
                    reason: errno_text(errno),
                    owner: None,
                    text: text(line).map(|t| shorten(&t)),
                }),
                Refusal::Commit(errno) => {
                    errors.push(format!("commit failed: {}", errno_text(errno)))
                }
                Refusal::Foreign(seq, errno) => {
                    errors.push(format!("message {seq} (not ours): {}", errno_text(errno)))
                }
                // Without the acknowledgement we cannot tell whether it applied.
                Refusal::Unacknowledged { sent } => errors.push(format!(
                    "the last of {sent} messages was not acknowledged; state unknown"
                )),
            }
        }
        if !refused.is_empty() {
            refused.truncate(6);
            return Err(DataplaneError::Refused {
                tool: TOOL.into(),
                refused,
            });
        }
        if !errors.is_empty() {
            errors.truncate(6);
            return Err(DataplaneError::Apply {
                tool: TOOL.into(),
                message: errors.join(" | "),
            });
        }
        tracing::debug!(
            messages = batch.len(),
            bytes = batch.inner.bytes(),
            "nf_tables batch applied"
        );
        Ok(batch.inner.bytes())
    }
}

fn encode_err(e: EncodeError) -> DataplaneError {
    DataplaneError::Refused {
        tool: format!("{TOOL} encoder"),
        refused: vec![RefusedOp {
            line: e.line,
            reason: e.why,
            owner: None,
            text: (!e.text.is_empty()).then(|| shorten(&e.text)),
        }],
    }
}

impl NftBackend for NftNetlink {
    fn apply(&mut self, tx: &Transaction) -> Result<usize, DataplaneError> {
        // A sequence range for every message the batch may hold.
        let seq0 = next_seq(batch::max_messages(tx));
        let batch = batch::encode(tx, seq0).map_err(encode_err)?;
        self.send(batch, &|l| Some(tx.op_text(l - 1)))
    }

    fn apply_owned(&mut self, tx: Transaction) -> Result<usize, DataplaneError> {
        let seq0 = next_seq(batch::max_messages(&tx));
        let batch = batch::encode_owned(tx, seq0).map_err(encode_err)?;
        self.send(batch, &|_| None)
    }

    fn chain_has_rules(
        &mut self,
        family: IpFamily,
        table: &str,
        chain: &str,
    ) -> Result<bool, DataplaneError> {
        let mut a = Attrs::new();
        a.str(1, table).str(2, chain);
        let newrule = nft_type(msg::NEWRULE);
        // GETRULE dump of one chain: a few messages, never the whole table.
        let doing = format!("listing chain {chain}");
        let replies = self.dump(family, msg::GETRULE, &a, "our canary chain", &doing)?;
        Ok(replies.is_some_and(|r| r.iter().any(|r| r.ty == newrule)))
    }

    fn affinity_records(
        &mut self,
        family: IpFamily,
        table: &str,
        set: &str,
    ) -> Result<Vec<ElemKey>, DataplaneError> {
        let mut a = Attrs::new();
        a.str(1, table).str(2, set);
        let doing = format!("listing set {set}");
        let what = "an affinity set's elements";
        let Some(replies) = self.dump(family, msg::GETSETELEM, &a, what, &doing)? else {
            return Ok(Vec::new());
        };
        let fam = expr::Family::from(family);
        let newsetelem = nft_type(msg::NEWSETELEM);
        let mut out = Vec::new();
        for r in replies.iter().filter(|r| r.ty == newsetelem) {
            // nfgenmsg (4 bytes), then NFTA_SET_ELEM_LIST_ELEMENTS holding
            // NFTA_LIST_ELEMs, each with NFTA_SET_ELEM_KEY { NFTA_DATA_VALUE }.
            let attrs = ParsedAttrs::parse(r.payload().get(4..).unwrap_or_default());
            let Some(list) = attrs.nested(3) else {
                continue;
            };
            for (_, elem) in list.iter() {
                let key = ParsedAttrs::parse(elem)
                    .nested(1)
                    .and_then(|k| k.get(1))
                    .and_then(|b| batch::affinity_key(b, fam));
                out.extend(key);
            }
        }
        Ok(out)
    }

    fn read_table(
        &mut self,
        family: IpFamily,
        table: &str,
        skip_elements: &dyn Fn(&str) -> bool,
    ) -> Result<Option<Box<dyn TableView>>, DataplaneError> {
        let Some(replies) = self.get_table(family, table)? else {
            return Ok(None);
        };
        // NFTA_TABLE_USERDATA: nft's comment, `type 0, length, text NUL`.
        let comment = replies
            .iter()
            .filter(|r| r.ty == nft_type(msg::NEWTABLE))
            .find_map(|r| {
                let a = ParsedAttrs::parse(r.payload().get(4..).unwrap_or_default());
                let ud = a.get(6)?;
                let (&0, rest) = ud.split_first()? else {
                    return None;
                };
                let (&len, text) = rest.split_first()?;
                let text = text.get(..len as usize)?;
                Some(String::from_utf8_lossy(text.strip_suffix(&[0]).unwrap_or(text)).into_owned())
            });
        Ok(self
            .read_back(family, table, skip_elements, comment)?
            .map(|t| Box::new(t) as Box<dyn TableView>))
    }

    fn table_exists(&mut self, family: IpFamily, table: &str) -> Result<bool, DataplaneError> {
        Ok(self.get_table(family, table)?.is_some())
    }
}
