//! No import circle inside any crate (issue 11): for every crate under `services/*/src`, the
//! graph of its top-level modules — module `x` is `src/x.rs` or `src/x/**.rs`, and it depends on
//! `y` when its code names `crate::y` (a `use`, a path, or a `crate::{y, ..}` group) — has no
//! cycle. Comments (doc links included), string and character literals, and `#[cfg(test)]` items
//! are left out: they are not what the module's code depends on. The crate root (`lib.rs`,
//! `main.rs`) declares the modules and is not part of the graph; `src/bin` holds other crates.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

type Graph = BTreeMap<String, BTreeSet<String>>;

#[test]
fn no_crate_has_an_import_cycle_between_its_modules() {
    let services = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut crates: Vec<PathBuf> = fs::read_dir(&services)
        .expect("services/")
        .filter_map(|e| e.ok().map(|e| e.path().join("src")))
        .filter(|src| src.is_dir())
        .collect();
    crates.sort();
    assert!(
        crates.iter().any(|c| c.ends_with("core/src")),
        "no crates found under {}",
        services.display()
    );
    let mut report = Vec::new();
    for src in &crates {
        let graph = module_graph(src);
        for cycle in cycles(&graph) {
            report.push(format!(
                "{}: {}",
                src.parent().unwrap().file_name().unwrap().to_string_lossy(),
                cycle.join(" → ")
            ));
        }
    }
    assert!(
        report.is_empty(),
        "import cycles between modules:\n  {}",
        report.join("\n  ")
    );
}

/// The top-level modules of the crate at `src` and the modules each one names.
fn module_graph(src: &Path) -> Graph {
    let mut graph = Graph::new();
    let mut files = Vec::new();
    rust_files(src, &mut files);
    for file in files {
        let rel = file.strip_prefix(src).unwrap();
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = match first.strip_suffix(".rs") {
            Some("lib" | "main") => continue,
            Some(m) => m.to_string(),
            None if first == "bin" => continue,
            None => first.to_string(),
        };
        let code = without_test_items(&strip_comments_and_literals(
            &fs::read_to_string(&file).unwrap(),
        ));
        let deps = graph.entry(module.clone()).or_default();
        for dep in crate_references(&code) {
            if dep != module {
                deps.insert(dep);
            }
        }
    }
    // Only edges to modules of this crate (`crate::x` for an `x` re-exported by the root from
    // another crate has no file here and cannot be part of a cycle).
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for deps in graph.values_mut() {
        deps.retain(|d| modules.contains(d));
    }
    graph
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code with comments removed and the contents of string and character literals blanked
/// (so that neither a `crate::` in prose nor a brace in a string is read as code).
fn strip_comments_and_literals(code: &str) -> String {
    let b = code.as_bytes();
    let mut out = String::with_capacity(code.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                while i < b.len() {
                    if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                        depth += 1;
                        i += 2;
                    } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
                out.push(' ');
            }
            b'r' if is_raw_string_start(b, i) => {
                let mut j = i + 1;
                let mut hashes = 0;
                while b[j] == b'#' {
                    hashes += 1;
                    j += 1;
                }
                j += 1; // the opening quote
                let close: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                while j < b.len() && !b[j..].starts_with(&close) {
                    j += 1;
                }
                i = (j + close.len()).min(b.len());
                out.push_str("\"\"");
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            b'\'' => {
                // A character literal ('x', '\n', '\u{..}'), or a lifetime ('a) left as is.
                let end = if b.get(i + 1) == Some(&b'\\') {
                    b[i + 2..]
                        .iter()
                        .position(|c| *c == b'\'')
                        .map(|p| i + 2 + p)
                } else {
                    let len = code[i + 1..].chars().next().map_or(1, char::len_utf8);
                    (b.get(i + 1 + len) == Some(&b'\'')).then_some(i + 1 + len)
                };
                match end {
                    Some(end) => {
                        out.push_str("' '");
                        i = end + 1;
                    }
                    None => {
                        out.push('\'');
                        i += 1;
                    }
                }
            }
            _ => {
                let len = code[i..].chars().next().map_or(1, char::len_utf8);
                out.push_str(&code[i..i + len]);
                i += len;
            }
        }
    }
    out
}

fn is_raw_string_start(b: &[u8], i: usize) -> bool {
    if i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_') {
        return false;
    }
    let mut j = i + 1;
    while j < b.len() && b[j] == b'#' {
        j += 1;
    }
    b.get(j) == Some(&b'"')
}

/// The code without the items under `#[cfg(test)]` (a block item or one ending in `;`).
fn without_test_items(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at..];
        let b = item.as_bytes();
        let mut end = item.len();
        let mut depth = 0usize;
        for (k, c) in b.iter().enumerate() {
            match c {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = k + 1;
                        break;
                    }
                }
                b';' if depth == 0 => {
                    end = k + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    out
}

/// The first path segments after every `crate::` in `code`, including each member of a
/// `crate::{a, b::c, d as e}` group.
fn crate_references(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let b = code.as_bytes();
    let mut from = 0;
    while let Some(p) = code[from..].find("crate::") {
        let at = from + p;
        from = at + "crate::".len();
        // `crate` as a whole word (`$crate::` counts: the macro's module depends on the path).
        if at > 0 && (b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'_') {
            continue;
        }
        let rest = code[from..].trim_start();
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut member_start = true;
            let mut chars = group.char_indices().peekable();
            while let Some((k, c)) = chars.next() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    ',' if depth == 1 => member_start = true,
                    c if depth == 1 && member_start && is_ident_start(c) => {
                        let ident = identifier(&group[k..]);
                        if ident != "self" {
                            found.insert(ident.to_string());
                        }
                        member_start = false;
                        for _ in 1..ident.chars().count() {
                            chars.next();
                        }
                    }
                    _ => {}
                }
            }
        } else {
            let ident = identifier(rest);
            if !ident.is_empty() {
                found.insert(ident.to_string());
            }
        }
    }
    found
}

fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn identifier(s: &str) -> &str {
    let end = s
        .char_indices()
        .find(|(_, c)| !(c.is_alphanumeric() || *c == '_'))
        .map_or(s.len(), |(k, _)| k);
    &s[..end]
}

/// One cycle per strongly connected component of more than one module (Tarjan), as the path
/// that closes it, starting from its smallest module.
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    struct Tarjan<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        on_stack: BTreeSet<&'g str>,
        components: Vec<Vec<&'g str>>,
    }
    impl<'g> Tarjan<'g> {
        fn visit(&mut self, v: &'g str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in &self.graph[v] {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(lw);
                } else if self.on_stack.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low.get_mut(v).unwrap();
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                loop {
                    let w = self.stack.pop().unwrap();
                    self.on_stack.remove(w);
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    self.components.push(component);
                }
            }
        }
    }
    let mut t = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        components: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.components
        .into_iter()
        .map(|component| {
            let members: BTreeSet<&str> = component.into_iter().collect();
            let start = *members.first().unwrap();
            cycle_through(graph, &members, start)
        })
        .collect()
}

/// A shortest cycle from `start` back to it inside `members` (breadth-first).
fn cycle_through(graph: &Graph, members: &BTreeSet<&str>, start: &str) -> Vec<String> {
    let mut parent: BTreeMap<&str, &str> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(v) = queue.pop_front() {
        for w in &graph[v] {
            let w = w.as_str();
            if !members.contains(w) {
                continue;
            }
            if w == start {
                let mut path = vec![start.to_string()];
                let mut at = v;
                while at != start {
                    path.push(at.to_string());
                    at = parent[at];
                }
                path.push(start.to_string());
                let last = path.len() - 1;
                path[1..last].reverse();
                return path;
            }
            if !parent.contains_key(w) && w != start {
                parent.insert(w, v);
                queue.push_back(w);
            }
        }
    }
    members.iter().map(|m| m.to_string()).collect()
}

#[test]
fn the_parser_finds_references_and_ignores_prose_literals_and_tests() {
    let code = r##"
        //! See [`x`](crate::prose).
        use crate::{a, b::{c, d}, e as f, self};
        use crate::g::H;
        /* crate::comment */
        fn f() { let s = "crate::string {"; let r = r#"crate::raw"#; let c = '{'; let _ = crate::h(); }
        fn l<'a>(x: &'a str) -> &'a str { x }
        #[cfg(test)]
        mod tests { use crate::testonly; fn x() { if true { } } }
        #[cfg(test)]
        use crate::testimport;
        macro_rules! m { () => { $crate::i::J } }
    "##;
    let refs = crate_references(&without_test_items(&strip_comments_and_literals(code)));
    let expected: BTreeSet<String> = ["a", "b", "e", "g", "h", "i"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(refs, expected);
}

#[test]
fn cycles_are_found_and_named() {
    let graph: Graph = [
        ("config", vec!["lease"]),
        ("lease", vec!["telemetry"]),
        ("telemetry", vec!["role"]),
        ("role", vec!["stage"]),
        ("stage", vec!["config", "domain"]),
        ("domain", vec![]),
        ("x", vec!["y"]),
        ("y", vec![]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(
        cycles(&graph),
        vec![vec![
            "config",
            "lease",
            "telemetry",
            "role",
            "stage",
            "config"
        ]]
    );
    let acyclic: Graph = graph
        .into_iter()
        .map(|(k, mut v)| {
            v.remove("config");
            (k, v)
        })
        .collect();
    assert!(cycles(&acyclic).is_empty());
}
