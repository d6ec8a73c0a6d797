//! Helpers shared by the integration tests: paths, and a small parser of
//! the C declarations found in the vmm_arena headers.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::PathBuf;

/// The ffi crate's directory.
pub fn ffi_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The contract header: `$VMM_ARENA_CONTRACT_HEADER`, else
/// `../shared/abi/vmm_arena.h` relative to the repository root. `None` (with
/// a message) when it is not there.
pub fn contract_header() -> Option<PathBuf> {
    let path = match std::env::var_os("VMM_ARENA_CONTRACT_HEADER") {
        Some(p) => PathBuf::from(p),
        None => ffi_dir().join("../../shared/abi/vmm_arena.h"),
    };
    if path.is_file() {
        Some(path.canonicalize().unwrap_or(path))
    } else {
        eprintln!(
            "SKIPPED: the contract header {} is missing (set VMM_ARENA_CONTRACT_HEADER to check against it)",
            path.display()
        );
        None
    }
}

/// One top-level C declaration, normalized so that spelling differences
/// that do not change the declaration (whitespace, comments, parameter
/// names, `struct T`/`enum T` for a typedef'd tag `T`) compare equal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decl {
    /// `#define NAME VALUE`: the value's text.
    Define(String),
    /// `typedef enum NAME { .. } NAME`: enumerators and values, in order.
    Enum(Vec<(String, i64)>),
    /// `typedef struct NAME { .. } NAME`: (type, name) of each field, in order.
    Struct(Vec<(String, String)>),
    /// `typedef struct NAME NAME` (opaque).
    Opaque,
    /// `typedef TYPE NAME`: the type (a function pointer as `ret (*)(types)`).
    Typedef(String),
    /// A function: return type and parameter types.
    Function(String, Vec<String>),
}

/// A parsed declaration and its source text (comments removed).
#[derive(Clone, Debug)]
pub struct Item {
    pub decl: Decl,
    pub text: String,
}

fn strip_comments(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            let end = src[i + 2..].find("*/").map(|e| i + 2 + e + 2).unwrap_or(b.len());
            out.push(' ');
            i = end;
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'"' {
            let end = src[i + 1..].find('"').map(|e| i + 1 + e + 1).unwrap_or(b.len());
            out.push_str(&src[i..end]);
            i = end;
        } else {
            let ch = src[i..].chars().next().expect("in bounds");
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

fn tokenize(s: &str) -> Vec<String> {
    let mut toks = Vec::new();
    let mut cur = String::new();
    for ch in s.chars() {
        if ch.is_ascii_alphanumeric() || ch == '_' {
            cur.push(ch);
        } else {
            if !cur.is_empty() {
                toks.push(std::mem::take(&mut cur));
            }
            if !ch.is_whitespace() {
                toks.push(ch.to_string());
            }
        }
    }
    if !cur.is_empty() {
        toks.push(cur);
    }
    toks
}

fn is_ident(t: &str) -> bool {
    t.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
}

/// Splits `toks` at `sep` tokens outside parentheses and braces.
fn split_top(toks: &[String], sep: &str) -> Vec<Vec<String>> {
    let mut parts = vec![Vec::new()];
    let mut depth = 0i32;
    for t in toks {
        match t.as_str() {
            "(" | "{" => depth += 1,
            ")" | "}" => depth -= 1,
            _ => {}
        }
        if depth == 0 && t == sep {
            parts.push(Vec::new());
        } else {
            parts.last_mut().expect("never empty").push(t.clone());
        }
    }
    parts.retain(|p| !p.is_empty());
    parts
}

/// Joins type tokens, dropping `struct`/`enum` before a tag (every tag in
/// these headers is also a typedef name).
fn type_text(toks: &[String]) -> String {
    toks.iter().filter(|t| *t != "struct" && *t != "enum").cloned().collect::<Vec<_>>().join(" ")
}

/// The parameter types of a parenthesized list (names dropped).
fn param_types(toks: &[String]) -> Vec<String> {
    let params = split_top(toks, ",");
    if params.len() == 1 && params[0] == ["void"] {
        return Vec::new();
    }
    params
        .into_iter()
        .map(|p| {
            let n = if p.len() >= 2 && is_ident(p.last().expect("len >= 2")) { p.len() - 1 } else { p.len() };
            type_text(&p[..n])
        })
        .collect()
}

fn parse_int(t: &str) -> i64 {
    let t = t.trim_end_matches(['u', 'U', 'l', 'L']);
    match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(h) => i64::from_str_radix(h, 16),
        None => t.parse(),
    }
    .unwrap_or_else(|_| panic!("not an integer: {t}"))
}

fn parse_statement(toks: &[String]) -> Option<(String, Decl)> {
    let open = |what: &str| toks.iter().position(|t| t == what);
    if toks.first().map(String::as_str) == Some("typedef") {
        let rest = &toks[1..];
        let kw = rest.first().map(String::as_str);
        if let (Some("enum" | "struct"), Some(lb)) = (kw, open("{")) {
            let rb = toks.iter().rposition(|t| t == "}").expect("a closing brace");
            let name = toks.last().expect("a name").clone();
            let body = &toks[lb + 1..rb];
            if kw == Some("enum") {
                let vars = split_top(body, ",")
                    .into_iter()
                    .map(|v| match v.as_slice() {
                        [n, eq, val] if eq == "=" => (n.clone(), parse_int(val)),
                        other => panic!("enumerator without an explicit value: {other:?}"),
                    })
                    .collect();
                return Some((name, Decl::Enum(vars)));
            }
            let fields = split_top(body, ";")
                .into_iter()
                .map(|f| {
                    let (name, ty) = f.split_last().expect("a field");
                    (type_text(ty), name.clone())
                })
                .collect();
            return Some((name, Decl::Struct(fields)));
        }
        if kw == Some("struct") && rest.len() == 3 {
            return Some((rest[2].clone(), Decl::Opaque));
        }
        // Function pointer: typedef RET ( * NAME ) ( PARAMS )
        if let Some(lp) = open("(") {
            if toks.get(lp + 1).map(String::as_str) == Some("*") {
                let name = toks[lp + 2].clone();
                let ret = type_text(&toks[1..lp]);
                let params = param_types(&toks[lp + 5..toks.len() - 1]);
                return Some((name, Decl::Typedef(format!("{ret} (*)({})", params.join(", ")))));
            }
        }
        let (name, ty) = rest.split_last().expect("a typedef name");
        return Some((name.clone(), Decl::Typedef(type_text(ty))));
    }
    let lp = open("(")?;
    let name = toks[lp - 1].clone();
    let ret = type_text(&toks[..lp - 1]);
    let params = param_types(&toks[lp + 1..toks.len() - 1]);
    Some((name, Decl::Function(ret, params)))
}

/// Every declaration of a header, by name. Blocks under `#ifdef
/// __cplusplus` (the `extern "C"` wrapper) are skipped.
pub fn parse_header(src: &str) -> BTreeMap<String, Item> {
    let src = strip_comments(src);
    let mut items = BTreeMap::new();
    let mut body = String::new();
    let mut skip_depth = 0usize;
    let mut if_depth = 0usize;
    for line in src.lines() {
        let t = line.trim();
        if let Some(directive) = t.strip_prefix('#') {
            let words: Vec<&str> = directive.split_whitespace().collect();
            match words.first().copied() {
                Some("if" | "ifdef" | "ifndef") => {
                    if_depth += 1;
                    if skip_depth == 0 && words.get(1) == Some(&"__cplusplus") && words[0] == "ifdef" {
                        skip_depth = if_depth;
                    }
                }
                Some("endif") => {
                    if skip_depth == if_depth {
                        skip_depth = 0;
                    }
                    if_depth = if_depth.saturating_sub(1);
                }
                Some("define") if skip_depth == 0 && words.len() >= 3 => {
                    let text = format!("#define {}", words[1..].join(" "));
                    items.insert(words[1].to_string(), Item { decl: Decl::Define(words[2..].join(" ")), text });
                }
                _ => {}
            }
            continue;
        }
        if skip_depth == 0 {
            body.push_str(line);
            body.push('\n');
        }
    }
    let toks = tokenize(&body);
    for stmt in split_top(&toks, ";") {
        let text = format!("{};", stmt.join(" "));
        if let Some((name, decl)) = parse_statement(&stmt) {
            items.insert(name, Item { decl, text });
        }
    }
    items
}
