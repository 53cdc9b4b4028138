//! `docs/formats.md` documents every key of every file format: each key path of the JSON
//! Schema (`rlc schema`) appears there, in the document's notation (`a.b`, `list[].key`,
//! `map.<name>.key`), under its file's heading.

use serde_json::Value;

fn resolve<'a>(s: &'a Value, root: &'a Value) -> &'a Value {
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        let name = r.rsplit('/').next().unwrap();
        return resolve(&root["definitions"][name], root);
    }
    for k in ["allOf", "anyOf"] {
        if let Some(subs) = s.get(k).and_then(Value::as_array) {
            if let Some(sub) = subs.iter().find(|x| x["type"] != "null") {
                return resolve(sub, root);
            }
        }
    }
    s
}

fn walk(s: &Value, root: &Value, prefix: &str, out: &mut Vec<String>) {
    let r = resolve(s, root);
    let is_array = r["type"] == "array"
        || r["type"]
            .as_array()
            .is_some_and(|t| t.iter().any(|x| x == "array"));
    if is_array {
        walk(&r["items"], root, &format!("{prefix}[]"), out);
        return;
    }
    match r.get("properties").and_then(Value::as_object) {
        Some(props) => {
            for (k, v) in props {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                out.push(path.clone());
                walk(v, root, &path, out);
            }
        }
        None => {
            if let Some(ap) = r.get("additionalProperties").filter(|a| a.is_object()) {
                walk(ap, root, &format!("{prefix}.<name>"), out);
            }
        }
    }
}

#[test]
fn every_key_of_every_format_is_in_docs_formats_md() {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/formats.md"),
    )
    .unwrap();
    let schema = schema::json_schema();
    let files = schema.as_object().unwrap();
    assert_eq!(files.len(), 5, "{:?}", files.keys());
    let mut missing = Vec::new();
    let mut total = 0;
    for (file, root) in files {
        let heading = format!("## `{file}`");
        let start = doc
            .find(&heading)
            .unwrap_or_else(|| panic!("no section {heading}"));
        let section = &doc[start..];
        let section = &section[..section[3..].find("\n## ").map_or(section.len(), |e| e + 3)];
        let mut keys = Vec::new();
        walk(root, root, "", &mut keys);
        for k in keys {
            total += 1;
            if !section.contains(&format!("| `{k}` |")) {
                missing.push(format!("{file}: {k}"));
            }
        }
    }
    assert!(total > 100, "{total} keys");
    assert!(
        missing.is_empty(),
        "docs/formats.md lacks these keys:\n{}",
        missing.join("\n")
    );
}
