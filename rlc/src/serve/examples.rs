//! Examples in the OpenAPI document: every request and response body of every operation gets
//! one ([`add_examples`]). A problem answer's example is the problem for its status and
//! description; an HTML, text or metrics answer a short sample; a JSON body a value built
//! from its schema ([`from_schema`]: the schema's own enum values and defaults, realistic
//! values for the fields the API uses everywhere — service `payments`, bucket `checkout`,
//! times, commits, rates), with a few written by hand where the generated one would say
//! little. A test checks every example against its schema ([`conforms`]).

use aide::openapi::{MediaType, OpenApi, ReferenceOr};
use serde_json::{json, Map, Value};

use super::problem::PROBLEM_JSON;

/// How deep generation follows nested schemas (the API's types are not recursive; this
/// bounds a future recursive one).
const MAX_DEPTH: usize = 48;

/// Adds an example to every media type of every request and response body that has none.
pub fn add_examples(api: &mut OpenApi) {
    let schemas: Map<String, Value> = api
        .components
        .as_ref()
        .map(|c| {
            c.schemas
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        serde_json::to_value(&v.json_schema).unwrap_or(Value::Null),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let Some(paths) = api.paths.as_mut() else {
        return;
    };
    for (path, item) in paths.paths.iter_mut() {
        let ReferenceOr::Item(item) = item else {
            continue;
        };
        for (method, op) in [
            ("get", item.get.as_mut()),
            ("post", item.post.as_mut()),
            ("put", item.put.as_mut()),
            ("delete", item.delete.as_mut()),
            ("patch", item.patch.as_mut()),
        ] {
            let Some(op) = op else { continue };
            if let Some(ReferenceOr::Item(body)) = op.request_body.as_mut() {
                for (_, media) in body.content.iter_mut() {
                    if media.example.is_none() {
                        media.example = Some(
                            hand_written(method, path, "request")
                                .unwrap_or_else(|| generated(media, &schemas)),
                        );
                    }
                }
            }
            let Some(responses) = op.responses.as_mut() else {
                continue;
            };
            for (status, r) in responses.responses.iter_mut() {
                let ReferenceOr::Item(r) = r else { continue };
                let code = match status {
                    aide::openapi::StatusCode::Code(c) => *c,
                    aide::openapi::StatusCode::Range(r) => *r * 100,
                };
                let description = r.description.clone();
                for (media_type, media) in r.content.iter_mut() {
                    if media.example.is_some() {
                        continue;
                    }
                    media.example = Some(example_for(
                        method,
                        path,
                        code,
                        media_type,
                        &description,
                        media,
                        &schemas,
                    ));
                }
            }
        }
    }
}

/// The example of one answer's media type.
fn example_for(
    method: &str,
    path: &str,
    code: u16,
    media_type: &str,
    description: &str,
    media: &MediaType,
    schemas: &Map<String, Value>,
) -> Value {
    if media_type == PROBLEM_JSON {
        let status = axum::http::StatusCode::from_u16(code).ok();
        let title = status.and_then(|s| s.canonical_reason()).unwrap_or("Error");
        let detail = description.trim().trim_end_matches('.').to_string();
        let compat = media
            .schema
            .as_ref()
            .and_then(|s| serde_json::to_value(&s.json_schema).ok())
            .and_then(|v| v.get("$ref").and_then(Value::as_str).map(str::to_string))
            .is_some_and(|r| r.ends_with("/CompatProblem"));
        let mut v =
            json!({"type": "about:blank", "title": title, "status": code, "detail": detail});
        if compat {
            v["error"] = v["detail"].clone();
        }
        return v;
    }
    if media_type.starts_with("text/html") {
        return json!("<!DOCTYPE html><html lang=\"en\">…</html>");
    }
    if media_type.starts_with("application/openmetrics-text") {
        return json!("# TYPE rlc_runs counter\nrlc_runs_total{status=\"success\"} 12\n# EOF\n");
    }
    if media_type.starts_with("text/") {
        return json!("ok");
    }
    hand_written(method, path, &code.to_string()).unwrap_or_else(|| generated(media, schemas))
}

/// The example generated from a media type's schema.
fn generated(media: &MediaType, schemas: &Map<String, Value>) -> Value {
    let schema = media
        .schema
        .as_ref()
        .and_then(|s| serde_json::to_value(&s.json_schema).ok())
        .unwrap_or(Value::Bool(true));
    from_schema(&schema, schemas, "", 0)
}

/// Examples written by hand, by method, path and status (`request` for the body).
fn hand_written(method: &str, path: &str, status: &str) -> Option<Value> {
    const SHA: &str = "4f1c2e0a9b8d7c6e5f4a3b2c1d0e9f8a7b6c5d4e";
    Some(match (method, path, status) {
        ("post", "/v1/runs", "request") => json!({}),
        ("post", "/v1/runs", "202") => json!({
            "queued": true,
            "run_uid": "r-20261130T030000Z-7f3a",
            "location": "/v1/runs/r-20261130T030000Z-7f3a"
        }),
        ("post", "/v1/previews", "request") => json!({
            "services": ["payments"],
            "policies": {"patch": {"services": {"payments": {"headroom": 0.5}}}}
        }),
        ("get", "/v1/shadow", "200") => json!({
            "service": "payments",
            "window": "1h",
            "since": "2026-11-30T02:00:00Z",
            "would_throttle_share": 0.01,
            "truncated": false,
            "buckets": [{
                "service": "payments", "bucket": "checkout", "reports": 3600,
                "offered": 540000.0, "admitted": 540000.0, "dropped": 0.0,
                "shadow_dropped": 27000.0, "virtual_drop_share": 0.05,
                "peak_offered_rps": 190.0, "max_drop_ratio": 0.21,
                "limit_rps": 150.0, "mode": "shadow",
                "first_seen": "2026-11-30T02:00:01Z", "last_seen": "2026-11-30T02:59:59Z",
                "would_throttle": true,
                "verdict": "would-throttle", "verdict_text": "would throttle 5.00%"
            }],
            "silent": [{
                "service": "payments", "bucket": "refund", "limit_rps": 50.0,
                "mode": "enforce", "verdict": "silent",
                "verdict_text": "no reports in the last 1h"
            }],
            "config_error": null,
            "incomplete": []
        }),
        ("get", "/v1/runs", "200") => json!({"runs": [{
            "id": 42, "trigger": "schedule",
            "started_at": "2026-11-30T03:00:00Z", "finished_at": "2026-11-30T03:00:12Z",
            "status": "success", "commit_sha": SHA, "version_pushed": SHA,
            "services": [{"service": "payments", "outcome": "committed", "changes": 1}],
            "summary": "rlc run (schedule): success\n  payments: raised checkout 150 → 173",
            "error": null, "run_uid": "r-20261130T030000Z-7f3a",
            "pull_request": null,
            "commit_url": format!("https://github.com/acme/config/commit/{SHA}")
        }]}),
        _ => return None,
    })
}

/// A realistic value for a field named `name` of type `ty`, if the name says what it is.
fn by_name(name: &str, ty: &str, format: Option<&str>) -> Option<Value> {
    let v = match (ty, name) {
        ("string", _) if format == Some("date-time") => json!("2026-11-30T03:00:00Z"),
        ("string", "service" | "callee") => json!("payments"),
        ("string", "bucket") => json!("checkout"),
        ("string", "caller") => json!("web"),
        ("string", "procedure") => json!("/payments.v1.Payments/Charge"),
        ("string", "window") => json!("1h"),
        ("string", "mode") => json!("shadow"),
        ("string", "policy") => json!("peak"),
        ("string", "trigger") => json!("schedule"),
        ("string", "status") => json!("success"),
        ("string", "scope_key") => json!("global"),
        ("string", "run_uid") => json!("r-20261130T030000Z-7f3a"),
        ("string", n) if n.contains("commit") || n.contains("version") || n == "sha" => {
            json!("4f1c2e0a9b8d7c6e5f4a3b2c1d0e9f8a7b6c5d4e")
        }
        ("string", n) if n.ends_with("url") => json!("https://github.com/acme/config/pull/7"),
        ("string", n) if n.ends_with("_at") || n == "t" || n == "since" => {
            json!("2026-11-30T03:00:00Z")
        }
        ("number", n) if n.ends_with("share") || n.ends_with("ratio") || n == "coverage" => {
            json!(0.05)
        }
        ("number", n) if n.contains("rps") || n.starts_with("limit") => json!(150.0),
        ("number", "headroom") => json!(0.25),
        ("integer", "id" | "run_id") => json!(42),
        ("integer", "number") => json!(7),
        _ => return None,
    };
    Some(v)
}

/// A value conforming to `schema` (`$ref`s resolved in `schemas`); `name` is the property it
/// is for, if any.
pub fn from_schema(
    schema: &Value,
    schemas: &Map<String, Value>,
    name: &str,
    depth: usize,
) -> Value {
    let Some(s) = schema.as_object() else {
        return Value::Null;
    };
    if depth > MAX_DEPTH {
        return Value::Null;
    }
    if let Some(v) = given(s, schemas, name, depth) {
        return v;
    }
    let ty = match s.get("type") {
        Some(Value::String(t)) => t.clone(),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .find(|t| *t != "null")
            .unwrap_or("null")
            .to_string(),
        _ if s.contains_key("properties") => "object".into(),
        _ => return json!({}),
    };
    let format = s.get("format").and_then(Value::as_str);
    if let Some(v) = by_name(name, &ty, format) {
        return v;
    }
    of_type(&ty, s, schemas, name, depth)
}

/// The value `s` gives or points to, if any: a `$ref`'s target, an `example`, `default`,
/// `const`, first of `examples` or `enum`, the first non-null variant of `anyOf` / `oneOf`,
/// the parts of `allOf` merged.
fn given(
    s: &Map<String, Value>,
    schemas: &Map<String, Value>,
    name: &str,
    depth: usize,
) -> Option<Value> {
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        let target = r.rsplit('/').next().and_then(|n| schemas.get(n));
        return Some(target.map_or(Value::Null, |t| from_schema(t, schemas, name, depth + 1)));
    }
    for key in ["example", "default", "const"] {
        if let Some(v) = s.get(key) {
            return Some(v.clone());
        }
    }
    if let Some(v) = s
        .get("examples")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
    {
        return Some(v.clone());
    }
    if let Some(v) = s
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
    {
        return Some(v.clone());
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(variants) = s.get(key).and_then(Value::as_array) {
            // The first variant that is not null.
            let pick = variants
                .iter()
                .find(|v| v.get("type").and_then(Value::as_str) != Some("null"))
                .or(variants.first());
            return Some(pick.map_or(Value::Null, |v| from_schema(v, schemas, name, depth + 1)));
        }
    }
    if let Some(all) = s.get("allOf").and_then(Value::as_array) {
        let mut out = Map::new();
        for part in all {
            if let Value::Object(m) = from_schema(part, schemas, name, depth + 1) {
                out.extend(m);
            }
        }
        return Some(Value::Object(out));
    }
    None
}

/// A value of type `ty` conforming to `s`: an object with each property (or one
/// `payments` entry of a map), an array of one item (none when it may be empty and the
/// item is null), a window for a window pattern, the minimum for numbers (at least 1).
fn of_type(
    ty: &str,
    s: &Map<String, Value>,
    schemas: &Map<String, Value>,
    name: &str,
    depth: usize,
) -> Value {
    match ty {
        "object" => {
            let mut out = Map::new();
            if let Some(props) = s.get("properties").and_then(Value::as_object) {
                for (k, p) in props {
                    out.insert(k.clone(), from_schema(p, schemas, k, depth + 1));
                }
            } else if let Some(extra) = s.get("additionalProperties").filter(|a| a.is_object()) {
                out.insert(
                    "payments".into(),
                    from_schema(extra, schemas, "", depth + 1),
                );
            }
            Value::Object(out)
        }
        "array" => {
            let item = s
                .get("items")
                .map_or(Value::Null, |i| from_schema(i, schemas, name, depth + 1));
            let min = s.get("minItems").and_then(Value::as_u64).unwrap_or(0);
            if item.is_null() && min == 0 {
                json!([])
            } else {
                json!([item])
            }
        }
        "string" => match s.get("pattern").and_then(Value::as_str) {
            Some(p) if p.contains("smhdw") || p.contains("[smhd]") => json!("1h"),
            _ => json!("text"),
        },
        "integer" => json!(s.get("minimum").and_then(Value::as_i64).unwrap_or(0).max(1)),
        "number" => json!(s
            .get("minimum")
            .and_then(Value::as_f64)
            .unwrap_or(0.0)
            .max(1.0)),
        "boolean" => json!(false),
        _ => Value::Null,
    }
}

/// Why `v` does not conform to `schema` (`$ref`s resolved in `schemas`), if it does not: the
/// checks the API's schemas use (type, enum, const, required, properties, additional
/// properties, items, anyOf / oneOf / allOf, minimum, maximum; not `pattern`).
#[cfg(test)]
pub fn conforms(
    v: &Value,
    schema: &Value,
    schemas: &Map<String, Value>,
    at: &str,
) -> Result<(), String> {
    let Some(s) = schema.as_object() else {
        return if schema == &Value::Bool(false) {
            Err(format!("{at}: nothing is allowed here"))
        } else {
            Ok(())
        };
    };
    if let Some(r) = s.get("$ref").and_then(Value::as_str) {
        let name = r.rsplit('/').next().unwrap_or_default();
        let t = schemas
            .get(name)
            .ok_or_else(|| format!("{at}: unknown schema {r}"))?;
        conforms(v, t, schemas, at)?;
    }
    if let Some(c) = s.get("const") {
        if c != v {
            return Err(format!("{at}: {v} is not {c}"));
        }
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        if !e.contains(v) {
            return Err(format!("{at}: {v} is none of {e:?}"));
        }
    }
    let type_ok = |t: &str| match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        _ => true,
    };
    match s.get("type") {
        Some(Value::String(t)) if !type_ok(t) => {
            return Err(format!("{at}: {v} is not of type {t}"));
        }
        Some(Value::Array(ts)) if !ts.iter().filter_map(Value::as_str).any(type_ok) => {
            return Err(format!("{at}: {v} is not of type {ts:?}"));
        }
        _ => {}
    }
    if let Some(n) = v.as_f64() {
        if s.get("minimum")
            .and_then(Value::as_f64)
            .is_some_and(|m| n < m)
        {
            return Err(format!("{at}: {n} is below the minimum"));
        }
        if s.get("maximum")
            .and_then(Value::as_f64)
            .is_some_and(|m| n > m)
        {
            return Err(format!("{at}: {n} is above the maximum"));
        }
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(variants) = s.get(key).and_then(Value::as_array) {
            if !variants.iter().any(|x| conforms(v, x, schemas, at).is_ok()) {
                return Err(format!("{at}: {v} matches no variant of {key}"));
            }
        }
    }
    if let Some(all) = s.get("allOf").and_then(Value::as_array) {
        for x in all {
            conforms(v, x, schemas, at)?;
        }
    }
    if let Some(obj) = v.as_object() {
        let props = s.get("properties").and_then(Value::as_object);
        for r in s
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let r = r.as_str().unwrap_or_default();
            if !obj.contains_key(r) {
                return Err(format!("{at}: `{r}` is required"));
            }
        }
        for (k, x) in obj {
            let here = format!("{at}.{k}");
            match props.and_then(|p| p.get(k)) {
                Some(p) => conforms(x, p, schemas, &here)?,
                None => match s.get("additionalProperties") {
                    Some(Value::Bool(false)) => {
                        return Err(format!("{here}: not a property of this object"))
                    }
                    Some(extra @ Value::Object(_)) => conforms(x, extra, schemas, &here)?,
                    _ => {}
                },
            }
        }
    }
    if let (Some(items), Some(arr)) = (s.get("items"), v.as_array()) {
        for (i, x) in arr.iter().enumerate() {
            conforms(x, items, schemas, &format!("{at}[{i}]"))?;
        }
    }
    Ok(())
}
