//! Service classes: named latency targets that requests ask for and every layer works to
//! meet, and the tenants whose API keys pin classes and namespace the KV cache.
//!
//! A class has a name, a TTFT target, an ITL target, optionally how long its requests may
//! wait before they are answered at once instead of computed (`expire`) and a share of the
//! capacity it may use under contention. Classes are given as flags or in a file, one per
//! line, in the same syntax: `interactive:ttft=300ms,itl=50ms`, `batch:ttft=30s,default`.
//! Their urgency is the order of their TTFT targets (tightest first; a class without one is
//! the least urgent): a request's [`ClassHint`] carries that rank, and engines order
//! waiting work by deadline (arrival plus the class's TTFT target) and let a more urgent
//! class displace a less urgent one, never the other way round.
//!
//! A request names its class with the `x-kvfabric-class` header or `kvfabric.class` in its
//! body; the spellings other servers take are understood too ([`Classes::resolve`]):
//! OpenAI's `service_tier` (`priority`: the most urgent class, `flex`: the least, `auto` and
//! `default`: the default), vLLM's `priority` (lower is more urgent; each class's number is
//! its rank less the default's, so 0 is the default class) and Dynamo's
//! `nvext.agent_hints.priority` and `x-dynamo-request-priority` (higher is more urgent;
//! negative values count as 0, as Dynamo clamps them). An unknown class or spelling is a
//! 400. A request that names none is of the default class: the one marked `default`, or the
//! least urgent.

use std::time::Duration;

use serde_json::Value;

pub use kvfabric::contract::generate::ClassHint;

/// One service class.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceClass {
    /// Its name: letters, digits, `-` and `_`, at most [`NAME_MAX`] bytes.
    pub name: String,
    /// Time to first token its requests are scheduled to meet.
    pub ttft: Option<Duration>,
    /// Gap between tokens (and mean time per output token) its requests are scheduled to
    /// meet.
    pub itl: Option<Duration>,
    /// Requests not started this long after their arrival are answered at once (expired).
    pub expire: Option<Duration>,
    /// The share of capacity (0..=1) the class may hold when others wait: the frontend's
    /// pending queue holds its requests back beyond it while requests of other classes wait
    /// (engines do not reserve it).
    pub share: Option<f64>,
    /// Marked as the default class.
    pub default: bool,
}

/// Longest class name.
pub const NAME_MAX: usize = 32;
/// Most classes.
pub const CLASSES_MAX: usize = 16;

/// Why a class spec or a request's class was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClassError {
    /// A spec that does not parse.
    #[error("class {spec:?}: {why}")]
    Spec {
        /// The spec.
        spec: String,
        /// What is wrong.
        why: String,
    },
    /// A request named a class that is not configured.
    #[error("unknown service class {name:?} (classes: {known})")]
    Unknown {
        /// The name asked for.
        name: String,
        /// The classes configured.
        known: String,
    },
    /// A request's class field is not of a form understood.
    #[error("{field}: {why}")]
    Field {
        /// The header or body field.
        field: &'static str,
        /// What is wrong.
        why: String,
    },
    /// The request's API key may not use the class.
    #[error("this API key may not use service class {name:?} (allowed: {allowed})")]
    NotAllowed {
        /// The class.
        name: String,
        /// Those it may use.
        allowed: String,
    },
}

impl ClassError {
    /// The request field at fault, for the API's `param`.
    pub fn param(&self) -> &'static str {
        match self {
            ClassError::Field { field, .. } => field,
            _ => "class",
        }
    }
}

/// A duration such as `300ms`, `2s`, `1.5s`, `2m`; a bare number is milliseconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, scale) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = s.strip_suffix("us") {
        (n, 1e-6)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = s.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (s, 1e-3)
    };
    let v: f64 = num.trim().parse().map_err(|_| format!("{s:?} is not a duration (300ms, 2s)"))?;
    let secs = v * scale;
    // Bounded before it becomes a Duration: no request waits longer than a day.
    if !(secs > 0.0 && secs <= 86_400.0) {
        return Err(format!("{s:?} is outside (0, 24h]"));
    }
    Ok(Duration::from_secs_f64(secs))
}

impl std::str::FromStr for ServiceClass {
    type Err = ClassError;

    /// `NAME[:key=value,...]`: `ttft`, `itl`, `expire` (durations), `share` (a fraction, or a
    /// percentage `25%`), and the flag `default`.
    fn from_str(spec: &str) -> Result<Self, ClassError> {
        let bad = |why: String| ClassError::Spec { spec: spec.to_string(), why };
        let spec_t = spec.trim();
        let (name, rest) = spec_t.split_once(':').unwrap_or((spec_t, ""));
        let name = name.trim();
        if name.is_empty()
            || name.len() > NAME_MAX
            || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(bad(format!(
                "a class name is 1 to {NAME_MAX} letters, digits, '-' or '_'"
            )));
        }
        let mut c = ServiceClass {
            name: name.to_string(),
            ttft: None,
            itl: None,
            expire: None,
            share: None,
            default: false,
        };
        for part in rest.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').map_or((part, None), |(k, v)| (k.trim(), Some(v)));
            let dur = |v: Option<&str>| {
                v.ok_or_else(|| bad(format!("{k} needs a value ({k}=300ms)")))
                    .and_then(|v| parse_duration(v).map_err(|e| bad(format!("{k}: {e}"))))
            };
            match k {
                "ttft" => c.ttft = Some(dur(v)?),
                "itl" | "tpot" => c.itl = Some(dur(v)?),
                "expire" => c.expire = Some(dur(v)?),
                "share" => {
                    let v = v.ok_or_else(|| bad("share needs a value (share=0.25)".into()))?;
                    let x = match v.trim().strip_suffix('%') {
                        Some(p) => p.trim().parse::<f64>().map(|p| p / 100.0),
                        None => v.trim().parse::<f64>(),
                    }
                    .map_err(|_| bad(format!("share {v:?} is not a number")))?;
                    if !(x > 0.0 && x <= 1.0) {
                        return Err(bad(format!("share {v:?} is outside (0, 1]")));
                    }
                    c.share = Some(x);
                }
                "default" if v.is_none() => c.default = true,
                _ => {
                    return Err(bad(format!(
                        "unknown setting {part:?} (ttft, itl, expire, share, default)"
                    )))
                }
            }
        }
        Ok(c)
    }
}

/// The classes of a deployment, most urgent first. Empty: classes are off, every request is
/// first come first served.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Classes {
    list: Vec<ServiceClass>,
    default: usize,
}

impl Classes {
    /// Classes off.
    pub fn none() -> Self {
        Classes::default()
    }

    /// The classes of `specs` (flags) and of `file` (one spec per line, `#` comments).
    pub fn from_specs_and_file(
        specs: &[String],
        file: Option<&std::path::Path>,
    ) -> Result<Self, ClassError> {
        let mut all: Vec<ServiceClass> =
            specs.iter().map(|s| s.parse()).collect::<Result<_, _>>()?;
        if let Some(path) = file {
            let text = std::fs::read_to_string(path).map_err(|e| ClassError::Spec {
                spec: path.display().to_string(),
                why: format!("reading the classes file: {e}"),
            })?;
            for line in text.lines() {
                let line = line.split('#').next().unwrap_or("").trim();
                if !line.is_empty() {
                    all.push(line.parse()?);
                }
            }
        }
        Self::new(all)
    }

    /// These classes, ranked by TTFT target (tightest first; those without one last, in the
    /// order given).
    pub fn new(mut list: Vec<ServiceClass>) -> Result<Self, ClassError> {
        let bad = |why: String| ClassError::Spec { spec: "classes".into(), why };
        if list.len() > CLASSES_MAX {
            return Err(bad(format!("at most {CLASSES_MAX} classes")));
        }
        let mut names = std::collections::BTreeSet::new();
        for c in &list {
            if !names.insert(c.name.clone()) {
                return Err(bad(format!("class {:?} is given twice", c.name)));
            }
        }
        if list.iter().filter(|c| c.default).count() > 1 {
            return Err(bad("more than one class is marked default".into()));
        }
        list.sort_by_key(|c| c.ttft.unwrap_or(Duration::MAX));
        let default = list.iter().position(|c| c.default).unwrap_or(list.len().saturating_sub(1));
        Ok(Classes { list, default })
    }

    /// Whether any class is configured.
    pub fn enabled(&self) -> bool {
        !self.list.is_empty()
    }

    /// The classes, most urgent first.
    pub fn list(&self) -> &[ServiceClass] {
        &self.list
    }

    /// The default class's index.
    pub fn default_index(&self) -> usize {
        self.default
    }

    /// The index of the class named `name`.
    pub fn index_of(&self, name: &str) -> Result<usize, ClassError> {
        self.list.iter().position(|c| c.name == name).ok_or_else(|| ClassError::Unknown {
            name: name.chars().take(64).collect(),
            known: self.names(),
        })
    }

    fn names(&self) -> String {
        if self.list.is_empty() {
            return "none configured".into();
        }
        self.list.iter().map(|c| c.name.as_str()).collect::<Vec<_>>().join(", ")
    }

    /// Class `i`'s priority in vLLM's convention: its rank less the default's.
    pub fn vllm_priority(&self, i: usize) -> i32 {
        i as i32 - self.default as i32
    }

    /// The class of a vLLM `priority`: the least urgent whose number is at most `p` (the most
    /// urgent when all are above it).
    fn of_vllm_priority(&self, p: i64) -> usize {
        (0..self.list.len()).rev().find(|&i| i64::from(self.vllm_priority(i)) <= p).unwrap_or(0)
    }

    /// What an engine is told of class `i`.
    pub fn hint(&self, i: usize) -> Option<ClassHint> {
        let c = self.list.get(i)?;
        Some(ClassHint {
            name: c.name.clone(),
            rank: u8::try_from(i).unwrap_or(u8::MAX),
            priority: self.vllm_priority(i),
            ttft: c.ttft,
            itl: c.itl,
            expire: c.expire,
            share: c.share,
        })
    }

    /// The class a request asks for ([`Classes::named`]), or the default class; None when
    /// classes are off.
    pub fn resolve(
        &self,
        headers: &axum::http::HeaderMap,
        fields: ClassFields<'_>,
    ) -> Result<Option<usize>, ClassError> {
        let named = self.named(headers, fields)?;
        Ok(named.or(self.enabled().then_some(self.default)))
    }

    /// The class a request names, by its headers and body, in this order: the
    /// `x-kvfabric-class` header, `kvfabric.class`, `x-dynamo-request-priority`,
    /// `nvext.agent_hints.priority`, `service_tier`, `priority`; None when it names none
    /// (`service_tier` `auto` and `default` name the default class). Classes off, a request
    /// that names a class gets a 400 (there is none), one that sends a priority spelling is
    /// served as any other.
    pub fn named(
        &self,
        headers: &axum::http::HeaderMap,
        fields: ClassFields<'_>,
    ) -> Result<Option<usize>, ClassError> {
        let field = |field: &'static str, why: String| ClassError::Field { field, why };
        // The objects the class may be named in: anything else is a mistake to refuse, not
        // a field to ignore (`"kvfabric": "interactive"` would run in the default class).
        for (f, v) in [("kvfabric", fields.kvfabric), ("nvext", fields.nvext)] {
            match v {
                None | Some(Value::Null | Value::Object(_)) => {}
                Some(_) => return Err(field(f, "must be an object".into())),
            }
        }
        if let Some(v) = headers.get("x-kvfabric-class") {
            let name = v
                .to_str()
                .map_err(|_| field("x-kvfabric-class", "not a visible ASCII string".into()))?;
            return self.index_of(name.trim()).map(Some);
        }
        match fields.kvfabric.and_then(|k| k.get("class")) {
            None | Some(Value::Null) => {}
            Some(Value::String(name)) => return self.index_of(name).map(Some),
            Some(_) => return Err(field("kvfabric.class", "must be a string".into())),
        }
        let int = |f: &'static str, v: &Value| match v {
            Value::Number(n) => {
                n.as_i64().ok_or_else(|| field(f, format!("{n} is not an integer")))
            }
            _ => Err(field(f, "must be an integer".into())),
        };
        let mut dynamo = None;
        if let Some(v) = headers.get("x-dynamo-request-priority") {
            let s = v.to_str().unwrap_or("");
            let p = s.trim().parse::<i64>().map_err(|_| {
                field("x-dynamo-request-priority", format!("{s:?} is not an integer"))
            })?;
            dynamo = Some(p);
        } else if let Some(v) =
            fields.nvext.and_then(|n| n.pointer("/agent_hints/priority")).filter(|v| !v.is_null())
        {
            dynamo = Some(int("nvext.agent_hints.priority", v)?);
        }
        let tier = match fields.service_tier {
            None | Some(Value::Null) => None,
            Some(Value::String(t)) => match t.as_str() {
                "auto" | "default" | "priority" | "scale" | "flex" => Some(t.as_str()),
                other => {
                    return Err(field(
                        "service_tier",
                        format!("{other:?} is not one of auto, default, flex, priority"),
                    ))
                }
            },
            Some(_) => return Err(field("service_tier", "must be a string".into())),
        };
        let vllm = match fields.priority.filter(|v| !v.is_null()) {
            Some(v) => Some(int("priority", v)?),
            None => None,
        };
        if !self.enabled() {
            return Ok(None);
        }
        if let Some(p) = dynamo {
            // Higher is more urgent; Dynamo clamps negative values to 0.
            return Ok(Some(self.of_vllm_priority(-p.max(0))));
        }
        if let Some(t) = tier {
            return Ok(Some(match t {
                "priority" | "scale" => 0,
                "flex" => self.list.len() - 1,
                _ => self.default,
            }));
        }
        Ok(vllm.map(|p| self.of_vllm_priority(p)))
    }
}

/// The request fields a class may be named in, as the request's parser read them (each the
/// JSON value given, if any): `kvfabric` (`{"class": ...}`), `nvext` (Dynamo's
/// `agent_hints.priority`), OpenAI's `service_tier`, vLLM's `priority`.
#[derive(Debug, Clone, Copy, Default)]
pub struct ClassFields<'a> {
    /// `kvfabric`.
    pub kvfabric: Option<&'a Value>,
    /// `nvext`.
    pub nvext: Option<&'a Value>,
    /// `service_tier`.
    pub service_tier: Option<&'a Value>,
    /// `priority`.
    pub priority: Option<&'a Value>,
}

impl<'a> ClassFields<'a> {
    /// The fields of a whole JSON body (tests, and callers without a typed request).
    pub fn of(body: &'a Value) -> Self {
        ClassFields {
            kvfabric: body.get("kvfabric"),
            nvext: body.get("nvext"),
            service_tier: body.get("service_tier"),
            priority: body.get("priority"),
        }
    }
}

/// A tenant: who an API key is, the classes it may use and the KV cache namespace it reads
/// and writes.
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenant {
    /// Its name (in metrics and logs).
    pub name: String,
    /// Its API key (`Authorization: Bearer KEY`).
    pub key: kvfabric::secret::Secret,
    /// The classes it may use, the first its default; left out (None): every class. An
    /// empty list is refused (it would read as every class while naming none).
    #[serde(default)]
    pub classes: Option<Vec<String>>,
    /// The cache namespace: tenants with the same one share cached prompts; by default its
    /// own name, so that no other tenant can tell what it sent.
    #[serde(default)]
    pub cache_namespace: Option<String>,
    /// KV blocks its requests may hold in each worker's store (host and disk together):
    /// past it, its own oldest blocks go, never another tenant's. None: no quota.
    #[serde(default)]
    pub store_blocks: Option<u64>,
    /// Of them, blocks in each worker's host memory: past it, its own least recently used
    /// host blocks move to disk (where the worker has none, they go). None: no quota.
    #[serde(default)]
    pub host_blocks: Option<u64>,
    /// Of them, blocks on each worker's disk: past it, its own least recently used disk
    /// blocks go. None: no quota.
    #[serde(default)]
    pub disk_blocks: Option<u64>,
}

impl Tenant {
    /// What workers are told of it.
    pub fn hint(&self) -> kvfabric::contract::generate::TenantHint {
        kvfabric::contract::generate::TenantHint {
            name: self.name.clone(),
            store_blocks: self.store_blocks,
            host_blocks: self.host_blocks,
            disk_blocks: self.disk_blocks,
        }
    }

    /// The salt folded into the hashes of its requests' blocks.
    pub fn cache_salt(&self) -> String {
        format!("tenant\u{0}{}", self.cache_namespace.as_deref().unwrap_or(&self.name))
    }
}

/// The tenants of a frontend, by API key.
#[derive(Debug, Clone, Default)]
pub struct Tenants {
    by_key: Vec<Tenant>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantsFile {
    tenants: Vec<Tenant>,
}

impl Tenants {
    /// The tenants of a JSON file (`{"tenants": [{"name", "key", "classes", "cache_namespace"}]}`),
    /// checked against `classes`.
    pub fn from_file(path: &std::path::Path, classes: &Classes) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading the tenants file {}: {e}", path.display()))?;
        let f: TenantsFile = serde_json::from_str(&text)
            .map_err(|e| format!("the tenants file {}: {e}", path.display()))?;
        if f.tenants.is_empty() {
            return Err(format!(
                "the tenants file {} configures no tenant: it would leave the API open to \
                 anyone; add a tenant, or leave --tenants out (and set --api-key)",
                path.display()
            ));
        }
        Self::new(f.tenants, classes)
    }

    /// These tenants, checked: names and keys unique and not empty, classes configured.
    pub fn new(list: Vec<Tenant>, classes: &Classes) -> Result<Self, String> {
        let mut by_key: Vec<Tenant> = Vec::new();
        let mut names = std::collections::BTreeSet::new();
        for t in list {
            if t.name.is_empty() || t.key.len() < 8 {
                return Err(format!(
                    "tenant {:?}: a tenant needs a name and a key of at least 8 characters",
                    t.name
                ));
            }
            if !names.insert(t.name.clone()) {
                return Err(format!("tenant {:?} is given twice", t.name));
            }
            for (what, v) in [
                ("store_blocks", t.store_blocks),
                ("host_blocks", t.host_blocks),
                ("disk_blocks", t.disk_blocks),
            ] {
                if v == Some(0) {
                    return Err(format!(
                        "tenant {:?}: {what} must be at least 1 (leave it out for no quota)",
                        t.name
                    ));
                }
            }
            if t.classes.as_ref().is_some_and(Vec::is_empty) {
                return Err(format!(
                    "tenant {:?}: \"classes\": [] names no class; name the classes it may use, \
                     or leave the field out to let it use every class",
                    t.name
                ));
            }
            for c in t.classes.iter().flatten() {
                classes.index_of(c).map_err(|e| format!("tenant {:?}: {e}", t.name))?;
            }
            if by_key.iter().any(|o| o.key == t.key) {
                return Err("two tenants have the same key".into());
            }
            by_key.push(t);
        }
        Ok(Tenants { by_key })
    }

    /// Whether any tenant is configured.
    pub fn enabled(&self) -> bool {
        !self.by_key.is_empty()
    }

    /// Tenants configured.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// The tenant of `key` (compared in constant time against every key).
    pub fn by_key(&self, key: &str) -> Option<&Tenant> {
        let mut found = None;
        for t in &self.by_key {
            if t.key.matches(key.as_bytes()) {
                found = Some(t);
            }
        }
        found
    }

    /// The class a request of `tenant` gets, `named` the class it named (None: none): the
    /// deployment's default or the tenant's first class when it named none, a refusal for
    /// one the tenant may not use.
    pub fn class_for(
        tenant: &Tenant,
        classes: &Classes,
        named: Option<usize>,
    ) -> Result<Option<usize>, ClassError> {
        let Some(list) = tenant.classes.as_ref().filter(|l| !l.is_empty()) else {
            return Ok(named.or(classes.enabled().then_some(classes.default_index())));
        };
        let allowed: Vec<usize> = list.iter().filter_map(|c| classes.index_of(c).ok()).collect();
        match named {
            None => Ok(allowed.first().copied()),
            Some(i) if allowed.contains(&i) => Ok(Some(i)),
            Some(i) => Err(ClassError::NotAllowed {
                name: classes.list()[i].name.clone(),
                allowed: list.join(", "),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderMap;
    use serde_json::json;

    fn classes() -> Classes {
        let specs: Vec<String> = [
            "batch:ttft=30s,expire=120s",
            "interactive:ttft=300ms,itl=50ms",
            "standard:ttft=2s,default",
        ]
        .map(String::from)
        .to_vec();
        Classes::from_specs_and_file(&specs, None).unwrap()
    }

    fn resolve(h: &[(&str, &str)], body: Value) -> Result<Option<String>, ClassError> {
        let c = classes();
        let mut headers = HeaderMap::new();
        for (k, v) in h {
            headers.insert(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        Ok(c.resolve(&headers, ClassFields::of(&body))?.map(|i| c.list()[i].name.clone()))
    }

    #[test]
    fn specs_parse_and_rank_by_ttft() {
        let c = classes();
        let names: Vec<&str> = c.list().iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["interactive", "standard", "batch"]);
        assert_eq!(c.list()[0].itl, Some(Duration::from_millis(50)));
        assert_eq!(c.list()[2].expire, Some(Duration::from_secs(120)));
        assert_eq!(c.default_index(), 1);
        let h = c.hint(0).unwrap();
        assert_eq!((h.rank, h.priority, h.ttft), (0, -1, Some(Duration::from_millis(300))));
        assert_eq!(c.hint(2).unwrap().priority, 1);
        // With none marked, the least urgent is the default.
        let c =
            Classes::new(vec!["a:ttft=1s".parse().unwrap(), "b:ttft=9s".parse().unwrap()]).unwrap();
        assert_eq!(c.default_index(), 1);
        let share: ServiceClass = "x:share=25%".parse().unwrap();
        assert_eq!(share.share, Some(0.25));
        for bad in [
            "",
            "a b",
            "x:ttft",
            "x:ttft=fast",
            "x:ttft=0",
            "x:share=2",
            "x:colour=red",
            "x:ttft=100000h",
        ] {
            assert!(bad.parse::<ServiceClass>().is_err(), "{bad:?} parsed");
        }
        let twice = vec!["a".parse().unwrap(), "a".parse().unwrap()];
        assert!(Classes::new(twice).is_err());
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("250"), Ok(Duration::from_millis(250)));
    }

    #[test]
    fn every_spelling_of_a_class_is_understood() {
        assert_eq!(resolve(&[], json!({})).unwrap().as_deref(), Some("standard"));
        assert_eq!(
            resolve(
                &[("x-kvfabric-class", "batch")],
                json!({"kvfabric": {"class": "interactive"}})
            )
            .unwrap()
            .as_deref(),
            Some("batch")
        );
        let r = |b: Value| resolve(&[], b).unwrap().unwrap();
        assert_eq!(r(json!({"kvfabric": {"class": "interactive"}})), "interactive");
        assert_eq!(r(json!({"service_tier": "priority"})), "interactive");
        assert_eq!(r(json!({"service_tier": "flex"})), "batch");
        assert_eq!(r(json!({"service_tier": "auto"})), "standard");
        assert_eq!(r(json!({"service_tier": "default"})), "standard");
        // vLLM: lower first; 0 is the default class.
        assert_eq!(r(json!({"priority": -1})), "interactive");
        assert_eq!(r(json!({"priority": -50})), "interactive");
        assert_eq!(r(json!({"priority": 0})), "standard");
        assert_eq!(r(json!({"priority": 7})), "batch");
        // Dynamo: higher first, negative clamped to 0 (the default).
        assert_eq!(r(json!({"nvext": {"agent_hints": {"priority": 5}}})), "interactive");
        assert_eq!(r(json!({"nvext": {"agent_hints": {"priority": -3}}})), "standard");
        assert_eq!(
            resolve(&[("x-dynamo-request-priority", "2")], json!({"service_tier": "flex"}))
                .unwrap()
                .as_deref(),
            Some("interactive")
        );
    }

    #[test]
    fn unknown_classes_and_bad_fields_are_refused() {
        let e = resolve(&[("x-kvfabric-class", "gold")], json!({})).unwrap_err();
        assert!(matches!(&e, ClassError::Unknown { name, .. } if name == "gold"), "{e}");
        assert!(e.to_string().contains("interactive, standard, batch"), "{e}");
        for (h, b, param) in [
            (None, json!({"kvfabric": {"class": 3}}), "kvfabric.class"),
            (None, json!({"kvfabric": "interactive"}), "kvfabric"),
            (None, json!({"nvext": 1}), "nvext"),
            (None, json!({"service_tier": "turbo"}), "service_tier"),
            (None, json!({"priority": "high"}), "priority"),
            (None, json!({"priority": 1.5}), "priority"),
            (
                None,
                json!({"nvext": {"agent_hints": {"priority": "x"}}}),
                "nvext.agent_hints.priority",
            ),
            (Some(("x-dynamo-request-priority", "soon")), json!({}), "x-dynamo-request-priority"),
        ] {
            let e = resolve(h.as_slice(), b.clone()).unwrap_err();
            assert_eq!(e.param(), param, "{b}: {e}");
        }
        // Classes off: a priority spelling is served as any request, a class name is unknown.
        let off = Classes::none();
        let h = HeaderMap::new();
        assert_eq!(
            off.resolve(&h, ClassFields::of(&json!({"priority": 3, "service_tier": "flex"}))),
            Ok(None)
        );
        assert!(off.resolve(&h, ClassFields::of(&json!({"priority": "x"}))).is_err());
        assert!(off
            .resolve(&h, ClassFields::of(&json!({"kvfabric": {"class": "batch"}})))
            .is_err());
    }

    #[test]
    fn a_tenant_key_pins_its_classes() {
        let c = classes();
        let t = Tenant {
            name: "acme".into(),
            key: "acme-key-123".into(),
            classes: Some(vec!["batch".into(), "standard".into()]),
            cache_namespace: None,
            store_blocks: None,
            host_blocks: None,
            disk_blocks: None,
        };
        let ts = Tenants::new(vec![t.clone()], &c).unwrap();
        assert_eq!(ts.by_key("acme-key-123").map(|t| t.name.as_str()), Some("acme"));
        assert!(ts.by_key("acme-key-12").is_none() && ts.by_key("").is_none());
        // Named nothing: the tenant's first class.
        assert_eq!(Tenants::class_for(&t, &c, None), Ok(Some(2)));
        assert_eq!(Tenants::class_for(&t, &c, Some(1)), Ok(Some(1)));
        assert!(matches!(Tenants::class_for(&t, &c, Some(0)), Err(ClassError::NotAllowed { .. })));
        let bad = Tenant { classes: Some(vec!["gold".into()]), ..t.clone() };
        assert!(Tenants::new(vec![bad], &c).is_err());
        // `"classes": []` is refused, not read as every class; left out, it is every class.
        let none = Tenant { classes: Some(vec![]), ..t.clone() };
        assert!(Tenants::new(vec![none], &c).unwrap_err().contains("names no class"));
        let every = Tenant { classes: None, ..t.clone() };
        assert_eq!(Tenants::class_for(&every, &c, Some(0)), Ok(Some(0)));
        let bad = Tenant { store_blocks: Some(0), ..t.clone() };
        assert!(Tenants::new(vec![bad], &c).unwrap_err().contains("store_blocks"));
        let bad = Tenant { host_blocks: Some(0), ..t.clone() };
        assert!(Tenants::new(vec![bad], &c).unwrap_err().contains("host_blocks"));
        // Workers are told every quota.
        let quotas = Tenant { host_blocks: Some(4), disk_blocks: Some(16), ..t.clone() }.hint();
        assert_eq!(
            (quotas.host_blocks, quotas.disk_blocks, quotas.store_blocks),
            (Some(4), Some(16), None)
        );
        assert!(Tenants::new(vec![t.clone(), t.clone()], &c).is_err());
        let shared = Tenant { cache_namespace: Some("team".into()), ..t.clone() };
        assert_ne!(t.cache_salt(), shared.cache_salt());
    }
}
