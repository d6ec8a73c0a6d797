//! A reader for the arena's JSON snapshot (the library has no JSON
//! dependency, and neither do its tests): only what the snapshot uses.

use super::*;

/// A parsed JSON value (only what the snapshot uses: no floats, no escapes
/// beyond the basic ones).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Json {
    Null,
    Bool(bool),
    Num(u64),
    Str(String),
    Arr(Vec<Json>),
    Obj(BTreeMap<String, Json>),
}

impl Json {
    pub fn parse(text: &str) -> Json {
        let b = text.as_bytes();
        let mut at = 0;
        let v = parse_value(b, &mut at);
        skip_ws(b, &mut at);
        assert_eq!(at, b.len(), "trailing text after the JSON value");
        v
    }

    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(m) => m.get(key),
            _ => None,
        }
    }

    pub fn u64(&self, key: &str) -> u64 {
        match self.get(key) {
            Some(Json::Num(n)) => *n,
            other => panic!("field {key}: expected a number, got {other:?}"),
        }
    }

    pub fn bool(&self, key: &str) -> bool {
        match self.get(key) {
            Some(Json::Bool(b)) => *b,
            other => panic!("field {key}: expected a bool, got {other:?}"),
        }
    }

    pub fn str(&self, key: &str) -> &str {
        match self.get(key) {
            Some(Json::Str(s)) => s,
            other => panic!("field {key}: expected a string, got {other:?}"),
        }
    }
}

fn skip_ws(b: &[u8], at: &mut usize) {
    while *at < b.len() && b[*at].is_ascii_whitespace() {
        *at += 1;
    }
}

fn expect(b: &[u8], at: &mut usize, c: u8) {
    skip_ws(b, at);
    assert_eq!(b.get(*at), Some(&c), "expected {:?} at byte {}", c as char, *at);
    *at += 1;
}

fn parse_value(b: &[u8], at: &mut usize) -> Json {
    skip_ws(b, at);
    match b[*at] {
        b'{' => {
            *at += 1;
            let mut m = BTreeMap::new();
            skip_ws(b, at);
            if b[*at] == b'}' {
                *at += 1;
                return Json::Obj(m);
            }
            loop {
                let Json::Str(k) = parse_value(b, at) else { panic!("object key is not a string") };
                expect(b, at, b':');
                let v = parse_value(b, at);
                assert!(m.insert(k.clone(), v).is_none(), "duplicate key {k}");
                skip_ws(b, at);
                match b[*at] {
                    b',' => *at += 1,
                    b'}' => {
                        *at += 1;
                        return Json::Obj(m);
                    }
                    c => panic!("unexpected {:?} in object", c as char),
                }
            }
        }
        b'[' => {
            *at += 1;
            let mut v = Vec::new();
            skip_ws(b, at);
            if b[*at] == b']' {
                *at += 1;
                return Json::Arr(v);
            }
            loop {
                v.push(parse_value(b, at));
                skip_ws(b, at);
                match b[*at] {
                    b',' => *at += 1,
                    b']' => {
                        *at += 1;
                        return Json::Arr(v);
                    }
                    c => panic!("unexpected {:?} in array", c as char),
                }
            }
        }
        b'"' => {
            *at += 1;
            let mut s = String::new();
            while b[*at] != b'"' {
                if b[*at] == b'\\' {
                    *at += 1;
                    s.push(match b[*at] {
                        b'n' => '\n',
                        b't' => '\t',
                        c => c as char,
                    });
                } else {
                    s.push(b[*at] as char);
                }
                *at += 1;
            }
            *at += 1;
            Json::Str(s)
        }
        b't' if b[*at..].starts_with(b"true") => {
            *at += 4;
            Json::Bool(true)
        }
        b'f' if b[*at..].starts_with(b"false") => {
            *at += 5;
            Json::Bool(false)
        }
        b'n' if b[*at..].starts_with(b"null") => {
            *at += 4;
            Json::Null
        }
        c if c.is_ascii_digit() => {
            let start = *at;
            while *at < b.len() && b[*at].is_ascii_digit() {
                *at += 1;
            }
            Json::Num(std::str::from_utf8(&b[start..*at]).unwrap().parse().expect("number fits u64"))
        }
        c => panic!("unexpected {:?} at byte {}", c as char, *at),
    }
}
