//! The in-memory nftables kernel (`kp_nftables::fake::Fake`) itself: what
//! it refuses as nf_tables does, that a refused transaction changes
//! nothing, and that its dump compares content, not history. The tests
//! that use it to check the proxier are in partial_sync.rs.
#![allow(clippy::unwrap_used, clippy::expect_used)] // a test: a panic is its failure

use kp_model::{DataplaneError, IpFamily, RefusedOp};
use kp_nftables::fake::Fake;
use kp_nftables::types::{
    Addr, BaseChain, Chain, ChainType, DType, ElemKey, ElemValue, Expr, Hook, KeyField, MapName,
    Object, Rule, Set, SetType, Transaction, Verb, Verdict,
};
use kp_nftables::NftBackend;
const T: &str = "t";

fn tx() -> Transaction {
    Transaction::new(IpFamily::V4, T)
}

fn chain(name: &str) -> Object {
    Object::Chain(Chain::regular(name))
}

fn goto(c: &str) -> Verdict {
    Verdict::Goto(c.into())
}

/// `ip daddr @SET goto TARGET`
fn lookup_rule(set: &str, target: &str) -> Rule {
    Rule::new(vec![
        Expr::Lookup {
            key: vec![KeyField::Addr(Addr::Daddr)],
            set: set.into(),
        },
        Expr::Verdict(goto(target)),
    ])
}

fn set(name: &str, verdict_map: bool) -> Set {
    Set {
        name: name.into(),
        ty: SetType::Typed {
            key: vec![DType::Ipv4],
            verdict_map,
            timeout: None,
        },
    }
}

fn elems(name: &'static &'static str, items: &[(&str, Option<ElemValue>)]) -> Object {
    Object::Elements {
        set: MapName::Fixed(name),
        elems: items
            .iter()
            .map(|(ip, v)| (ElemKey::Ip(ip.parse().unwrap()), v.clone()))
            .collect(),
    }
}

/// Table t with chains a (jumping to b for addresses in set s) and b,
/// set s and verdict map m (one element going to b).
fn base() -> Fake {
    let mut fake = Fake::new();
    let mut t = tx();
    t.add(Object::Table { comment: None })
        .add(chain("a"))
        .add(chain("b"))
        .add(Object::Set(set("s", false)))
        .add(Object::Set(set("m", true)))
        .add_rule("a", lookup_rule("s", "b"))
        .add(elems(&"s", &[("10.0.0.2", None), ("10.0.0.1", None)]))
        .add(elems(
            &"m",
            &[("10.0.0.9", Some(ElemValue::Verdict(goto("b"))))],
        ));
    fake.apply(&t).unwrap();
    fake
}

fn refused(r: Result<usize, DataplaneError>) -> RefusedOp {
    match r {
        Err(DataplaneError::Refused { tool, mut refused }) => {
            assert_eq!(tool, "nftables fake");
            assert_eq!(refused.len(), 1, "{refused:?}");
            refused.remove(0)
        }
        other => panic!("not refused: {other:?}"),
    }
}

/// Applies `object` with `verb` alone; its refusal, if any.
fn one(fake: &mut Fake, verb: Verb, object: Object) -> Result<usize, DataplaneError> {
    let mut t = tx();
    t.push(verb, object);
    fake.apply(&t)
}

#[test]
fn create_of_an_existing_object_fails_add_keeps_it() {
    let mut fake = base();
    let before = fake.dump();
    for (object, what) in [
        (Object::Table { comment: None }, "table ip t"),
        (chain("a"), "chain a"),
        (Object::Set(set("s", false)), "set s"),
        (
            elems(&"s", &[("10.0.0.1", None)]),
            "element 10.0.0.1 of set s",
        ),
    ] {
        let r = refused(one(&mut fake, Verb::Create, object.clone()));
        assert!(r.reason.starts_with("File exists"), "{r:?}");
        assert!(r.reason.ends_with(what), "{what}: {r:?}");
        assert_eq!(r.line, 1);
        assert!(r.text.as_deref().unwrap().starts_with("create "), "{r:?}");
        one(&mut fake, Verb::Add, object).unwrap();
    }
    assert_eq!(fake.dump(), before);
    // A set declared otherwise, a map key holding another value.
    let r = refused(one(&mut fake, Verb::Add, Object::Set(set("s", true))));
    assert!(r.reason.contains("set s exists with another"), "{r:?}");
    let other = Some(ElemValue::Verdict(goto("a")));
    let r = refused(one(
        &mut fake,
        Verb::Add,
        elems(&"m", &[("10.0.0.9", other)]),
    ));
    assert!(
        r.reason
            .contains("element 10.0.0.9 of map m maps to goto b"),
        "{r:?}"
    );
    assert_eq!(fake.dump(), before);
}

#[test]
fn delete_or_flush_of_a_missing_object_fails() {
    let mut fake = base();
    let before = fake.dump();
    for (verb, object, what) in [
        (Verb::Delete, chain("zz"), "chain zz"),
        (Verb::Flush, chain("zz"), "chain zz"),
        (Verb::Delete, Object::Set(set("zz", false)), "set zz"),
        (Verb::Flush, Object::Set(set("zz", false)), "set zz"),
        (
            Verb::Delete,
            elems(&"s", &[("10.0.0.7", None)]),
            "element 10.0.0.7 of set s",
        ),
    ] {
        let r = refused(one(&mut fake, verb, object));
        assert!(r.reason.starts_with("No such file or directory"), "{r:?}");
        assert!(r.reason.ends_with(what), "{what}: {r:?}");
    }
    assert_eq!(fake.dump(), before);
    let mut empty = Fake::new();
    let r = refused(one(
        &mut empty,
        Verb::Delete,
        Object::Table { comment: None },
    ));
    assert!(r.reason.ends_with("table ip t"), "{r:?}");
    let r = refused(one(&mut empty, Verb::Add, chain("a")));
    assert!(r.reason.ends_with("table ip t"), "{r:?}");
}

#[test]
fn a_refused_transaction_changes_nothing() {
    let mut fake = base();
    let before = fake.dump();
    let mut t = tx();
    t.add(chain("c"))
        .flush(chain("a"))
        .add(elems(&"s", &[("10.0.0.3", None)]))
        .delete(elems(&"s", &[("10.0.0.1", None)]))
        .add_rule("c", lookup_rule("nope", "b"));
    let r = refused(fake.apply(&t));
    assert_eq!(r.line, 5);
    assert!(
        r.reason.ends_with("set nope (named by a rule of chain c)"),
        "{r:?}"
    );
    assert_eq!(fake.dump(), before);
    assert_eq!(fake.applied(), 1);
    // The same without its last operation applies.
    t.ops.pop();
    fake.apply(&t).unwrap();
    assert_ne!(fake.dump(), before);
    assert_eq!(fake.applied(), 2);
}

#[test]
fn flush_empties_rules_or_elements() {
    let mut fake = base();
    let mut t = tx();
    t.add_rule("b", Rule::new(vec![Expr::Verdict(Verdict::Drop)]));
    fake.apply(&t).unwrap();
    one(&mut fake, Verb::Flush, chain("a")).unwrap();
    let table = fake.table(IpFamily::V4, T).unwrap();
    assert!(table.chains["a"].rules.is_empty());
    assert_eq!(table.chains["b"].rules.len(), 1);
    assert_eq!(table.sets["s"].elements.len(), 2);
    // The whole table's rules; chains, sets and elements stay.
    one(&mut fake, Verb::Flush, Object::Table { comment: None }).unwrap();
    let table = fake.table(IpFamily::V4, T).unwrap();
    assert!(table.chains.values().all(|c| c.rules.is_empty()));
    assert_eq!(table.chains.len(), 2);
    assert_eq!(table.sets["s"].elements.len(), 2);
    one(&mut fake, Verb::Flush, Object::Set(set("s", false))).unwrap();
    let table = fake.table(IpFamily::V4, T).unwrap();
    assert!(table.sets["s"].elements.is_empty());
    assert_eq!(table.sets["m"].elements.len(), 1);
}

#[test]
fn elements_are_added_and_deleted() {
    let mut fake = base();
    one(&mut fake, Verb::Add, elems(&"s", &[("10.0.0.3", None)])).unwrap();
    one(&mut fake, Verb::Delete, elems(&"s", &[("10.0.0.1", None)])).unwrap();
    let keys: Vec<String> = fake.table(IpFamily::V4, T).unwrap().sets["s"]
        .elements
        .keys()
        .map(|k| k.to_string())
        .collect();
    assert_eq!(keys, ["10.0.0.2", "10.0.0.3"]);
    // A set takes no values, a map needs them.
    let v = Some(ElemValue::Verdict(goto("b")));
    let r = refused(one(&mut fake, Verb::Add, elems(&"s", &[("10.0.0.4", v)])));
    assert!(r.reason.contains("does not fit set s"), "{r:?}");
    let r = refused(one(
        &mut fake,
        Verb::Add,
        elems(&"m", &[("10.0.0.4", None)]),
    ));
    assert!(r.reason.contains("does not fit map m"), "{r:?}");
    // A verdict needs its chain.
    let v = Some(ElemValue::Verdict(goto("zz")));
    let r = refused(one(&mut fake, Verb::Add, elems(&"m", &[("10.0.0.4", v)])));
    assert!(r.reason.starts_with("No such file"), "{r:?}");
    assert!(
        r.reason.contains("chain zz (element 10.0.0.4 of map m"),
        "{r:?}"
    );
    // Whole sets are flushed, not their elements.
    let r = refused(one(
        &mut fake,
        Verb::Flush,
        elems(&"s", &[("10.0.0.2", None)]),
    ));
    assert!(r.reason.contains("cannot be flushed"), "{r:?}");
}

#[test]
fn what_is_still_named_cannot_be_deleted() {
    let mut fake = base();
    let before = fake.dump();
    // b: jumped to by a's rule and by m's element.
    let r = refused(one(&mut fake, Verb::Delete, chain("b")));
    assert!(r.reason.starts_with("Device or resource busy"), "{r:?}");
    assert!(
        r.reason
            .ends_with("chain b is still used by a rule of chain a"),
        "{r:?}"
    );
    let r = refused(one(&mut fake, Verb::Delete, Object::Set(set("s", false))));
    assert!(
        r.reason
            .ends_with("set s is still used by a rule of chain a"),
        "{r:?}"
    );
    assert_eq!(fake.dump(), before);
    // Once a is flushed, only m's element holds b.
    one(&mut fake, Verb::Flush, chain("a")).unwrap();
    one(&mut fake, Verb::Delete, Object::Set(set("s", false))).unwrap();
    let r = refused(one(&mut fake, Verb::Delete, chain("b")));
    assert!(r.reason.ends_with("an element of map m"), "{r:?}");
    one(&mut fake, Verb::Flush, Object::Set(set("m", true))).unwrap();
    one(&mut fake, Verb::Delete, chain("b")).unwrap();
    // A chain goes with its own rules.
    let mut t = tx();
    t.add(chain("c"))
        .add_rule("c", Rule::new(vec![Expr::Verdict(Verdict::Drop)]))
        .delete(chain("c"));
    fake.apply(&t).unwrap();
    assert!(!fake
        .table(IpFamily::V4, T)
        .unwrap()
        .chains
        .contains_key("c"));
}

#[test]
fn rules_need_their_chain_and_what_they_name() {
    let mut fake = base();
    let r = refused(one(
        &mut fake,
        Verb::Add,
        Object::Rule {
            chain: "zz".into(),
            rule: Rule::new(vec![Expr::Verdict(Verdict::Drop)]),
        },
    ));
    assert!(r.reason.ends_with("chain zz"), "{r:?}");
    let mut t = tx();
    t.add_rule("a", lookup_rule("s", "zz"));
    let r = refused(fake.apply(&t));
    assert!(
        r.reason
            .ends_with("chain zz (a rule of chain a sends packets there)"),
        "{r:?}"
    );
    // Not to a base chain.
    let mut t = tx();
    t.add(Object::Chain(Chain {
        name: "hooked".into(),
        base: Some(BaseChain {
            ty: ChainType::Nat,
            hook: Hook::Output,
            priority: -100,
        }),
    }))
    .add_rule("a", lookup_rule("s", "hooked"));
    let r = refused(fake.apply(&t));
    assert!(r.reason.contains("chain hooked is a base chain"), "{r:?}");
    // Rules are only added.
    let r = refused(one(
        &mut fake,
        Verb::Delete,
        Object::Rule {
            chain: "a".into(),
            rule: lookup_rule("s", "b"),
        },
    ));
    assert!(r.reason.contains("can only be added"), "{r:?}");
}

#[test]
fn the_dump_depends_on_content_not_on_order() {
    let build = |order: &[usize]| {
        let mut fake = Fake::new();
        let mut t = tx();
        t.add(Object::Table { comment: None });
        let parts = [
            vec![chain("b"), chain("a")],
            vec![
                Object::Set(set("s", false)),
                elems(&"s", &[("10.0.0.9", None), ("10.0.0.1", None)]),
            ],
            vec![Object::Set(set("x", false))],
        ];
        for &i in order {
            for o in &parts[i] {
                t.add(o.clone());
            }
        }
        t.add_rule("a", lookup_rule("s", "b"))
            .add_rule("a", Rule::new(vec![Expr::Verdict(Verdict::Drop)]));
        fake.apply(&t).unwrap();
        fake.dump()
    };
    let one = build(&[0, 1, 2]);
    assert_eq!(one, build(&[2, 1, 0]));
    assert!(
        one.contains("\ts element 10.0.0.1\n\ts element 10.0.0.9\n"),
        "{one}"
    );
    assert!(
        one.contains("\ta #0: ip daddr @s goto b\n\ta #1: drop\n"),
        "{one}"
    );
    let chains: Vec<&str> = one.lines().filter(|l| l.starts_with("chain")).collect();
    assert_eq!(chains, ["chain ip t a", "chain ip t b"]);
    // Rules keep their order: it is what the kernel runs.
    let mut fake = Fake::new();
    let mut t = tx();
    t.add(Object::Table { comment: None })
        .add(chain("a"))
        .add(chain("b"))
        .add(Object::Set(set("s", false)))
        .add(Object::Set(set("x", false)))
        .add(elems(&"s", &[("10.0.0.1", None), ("10.0.0.9", None)]))
        .add_rule("a", Rule::new(vec![Expr::Verdict(Verdict::Drop)]))
        .add_rule("a", lookup_rule("s", "b"));
    fake.apply(&t).unwrap();
    assert_ne!(fake.dump(), one);
}

#[test]
fn the_backend_questions_are_answered_from_the_state() {
    let mut fake = base();
    assert!(fake.table_exists(IpFamily::V4, T).unwrap());
    assert!(!fake.table_exists(IpFamily::V6, T).unwrap());
    assert!(fake.chain_has_rules(IpFamily::V4, T, "a").unwrap());
    assert!(!fake.chain_has_rules(IpFamily::V4, T, "b").unwrap());
    assert!(!fake.chain_has_rules(IpFamily::V4, T, "zz").unwrap());
    assert!(!fake.chain_has_rules(IpFamily::V6, T, "a").unwrap());
    let records = MapName::Affinity(60);
    let record = ElemKey::Affinity {
        client: "10.1.0.1".parse().unwrap(),
        id: 7,
        index: 1,
    };
    let mut t = tx();
    t.add(Object::Set(Set {
        name: records.to_string(),
        ty: SetType::Records { timeout: 60 },
    }))
    .add(Object::Elements {
        set: records,
        elems: vec![(record.clone(), None)],
    });
    fake.apply(&t).unwrap();
    let name = records.to_string();
    assert_eq!(
        fake.affinity_records(IpFamily::V4, T, &name).unwrap(),
        [record]
    );
    assert!(fake
        .affinity_records(IpFamily::V4, T, "s")
        .unwrap()
        .is_empty());
    assert!(fake
        .affinity_records(IpFamily::V6, T, &name)
        .unwrap()
        .is_empty());
    // Clones share the state; deleting the table empties it.
    let mut other = fake.clone();
    one(&mut other, Verb::Delete, Object::Table { comment: None }).unwrap();
    assert!(fake.state().tables.is_empty());
    assert_eq!(fake.dump(), "");
}
