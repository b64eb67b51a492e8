//! CORS (cross-origin requests from browsers), configured as vLLM's OpenAI server is: every
//! origin, method and request header is allowed by default, credentials are not
//! (`--allowed-origins`, `--allowed-methods`, `--allowed-headers`, `--allow-credentials`).
//!
//! Contract: a preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) is
//! answered by tower-http's `CorsLayer` before routing and before the API-key check, since
//! browsers send no `Authorization` header on a preflight; every other response, errors
//! included, carries the CORS headers the configuration allows. An `OPTIONS` request that is not
//! a preflight is routed like any other request (the API routes answer it with a 405), as in
//! vLLM, where Starlette passes such requests on.

use axum::http::{HeaderName, HeaderValue, Method};
use std::time::Duration;
use tower_http::cors::{AllowHeaders, AllowMethods, AllowOrigin, CorsLayer};

/// The CORS settings of a server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CorsConfig {
    /// Origins allowed to call the API (`scheme://host[:port]`, compared exactly); `*` allows
    /// any.
    pub allowed_origins: Vec<String>,
    /// Methods a preflight allows; `*` stands for DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT.
    pub allowed_methods: Vec<String>,
    /// Request headers a preflight allows (besides Accept, Accept-Language, Content-Language
    /// and Content-Type, always allowed); `*` allows whatever the browser asks for.
    pub allowed_headers: Vec<String>,
    /// Answer `Access-Control-Allow-Credentials: true` (cookies, HTTP authentication). Browsers
    /// refuse `Access-Control-Allow-Origin: *` on such requests, so with `*` origins the
    /// request's own origin is sent back instead.
    pub allow_credentials: bool,
}

impl Default for CorsConfig {
    /// vLLM's defaults: every origin, method and header, no credentials.
    fn default() -> Self {
        let any = || vec![WILDCARD.to_owned()];
        Self {
            allowed_origins: any(),
            allowed_methods: any(),
            allowed_headers: any(),
            allow_credentials: false,
        }
    }
}

/// The list entry that allows everything.
pub const WILDCARD: &str = "*";

/// How long a browser may reuse a preflight's answer (Starlette's default, which vLLM sends).
pub const PREFLIGHT_MAX_AGE: Duration = Duration::from_secs(600);

/// What `*` stands for in `allowed_methods` (Starlette's list).
const ALL_METHODS: [Method; 7] = [
    Method::DELETE,
    Method::GET,
    Method::HEAD,
    Method::OPTIONS,
    Method::PATCH,
    Method::POST,
    Method::PUT,
];

/// Headers a preflight always allows next to an explicit `allowed_headers` list (Starlette
/// adds them too; `Content-Type: application/json` is not CORS-safelisted, so without it no
/// browser could send a JSON body).
const ALWAYS_ALLOWED_HEADERS: [&str; 4] = [
    "accept",
    "accept-language",
    "content-language",
    "content-type",
];

fn has_wildcard(list: &[String]) -> bool {
    list.iter().any(|s| s == WILDCARD)
}

/// Parses a list flag as vLLM takes it, a JSON list of strings (`'["http://a.example"]'`), or
/// comma-separated values (`http://a.example,http://b.example`); empty entries are dropped.
///
/// # Errors
/// Text that starts with `[` and is not a JSON list of strings.
pub fn parse_list(s: &str) -> Result<Vec<String>, String> {
    let t = s.trim();
    if t.starts_with('[') {
        return serde_json::from_str::<Vec<String>>(t)
            .map_err(|e| format!("{s:?} is not a JSON list of strings: {e}"));
    }
    Ok(t.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(str::to_owned)
        .collect())
}

fn origin_value(o: &str) -> Result<HeaderValue, String> {
    HeaderValue::from_str(o).map_err(|_| format!("{o:?} is not a valid origin"))
}

fn method_value(m: &str) -> Result<Method, String> {
    Method::from_bytes(m.as_bytes()).map_err(|_| format!("{m:?} is not a valid HTTP method"))
}

fn header_name(h: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(h.as_bytes()).map_err(|_| format!("{h:?} is not a valid header name"))
}

/// Checks that each entry but `*` can appear in a header, with `check`.
fn check_each<T>(list: &[String], check: fn(&str) -> Result<T, String>) -> Result<Vec<T>, String> {
    list.iter()
        .filter(|s| *s != WILDCARD)
        .map(|s| check(s))
        .collect()
}

/// [`parse_list`] for `--allowed-origins`, each origin checked.
///
/// # Errors
/// A bad list, or an origin that cannot be a header value.
pub fn parse_origins(s: &str) -> Result<Vec<String>, String> {
    let v = parse_list(s)?;
    check_each(&v, origin_value)?;
    Ok(v)
}

/// [`parse_list`] for `--allowed-methods`, each method checked.
///
/// # Errors
/// A bad list, or a method name that is not an HTTP token.
pub fn parse_methods(s: &str) -> Result<Vec<String>, String> {
    let v = parse_list(s)?;
    check_each(&v, method_value)?;
    Ok(v)
}

/// [`parse_list`] for `--allowed-headers`, each header name checked.
///
/// # Errors
/// A bad list, or a header name that is not an HTTP token.
pub fn parse_headers(s: &str) -> Result<Vec<String>, String> {
    let v = parse_list(s)?;
    check_each(&v, header_name)?;
    Ok(v)
}

impl CorsConfig {
    /// The tower-http layer for these settings. It never combines credentials with a `*`
    /// answer (which would make `CorsLayer` panic when applied): with credentials, `*`
    /// origins echo the request's origin, and `*` methods and headers are never sent as `*`.
    ///
    /// # Errors
    /// An origin, method or header name that cannot appear in an HTTP header, named.
    pub fn layer(&self) -> Result<CorsLayer, String> {
        let origins = if has_wildcard(&self.allowed_origins) {
            if self.allow_credentials {
                AllowOrigin::mirror_request()
            } else {
                AllowOrigin::any()
            }
        } else {
            AllowOrigin::list(check_each(&self.allowed_origins, origin_value)?)
        };
        let methods = if has_wildcard(&self.allowed_methods) {
            ALL_METHODS.to_vec()
        } else {
            check_each(&self.allowed_methods, method_value)?
        };
        let headers = if has_wildcard(&self.allowed_headers) {
            AllowHeaders::mirror_request()
        } else {
            let mut names = check_each(&self.allowed_headers, header_name)?;
            for h in ALWAYS_ALLOWED_HEADERS {
                let h = HeaderName::from_static(h);
                if !names.contains(&h) {
                    names.push(h);
                }
            }
            AllowHeaders::list(names)
        };
        Ok(CorsLayer::new()
            .allow_origin(origins)
            .allow_methods(AllowMethods::list(methods))
            .allow_headers(headers)
            .allow_credentials(self.allow_credentials)
            .max_age(PREFLIGHT_MAX_AGE))
    }
}

/// True for a CORS preflight: `OPTIONS` with `Origin` and `Access-Control-Request-Method`.
pub fn is_preflight(method: &Method, headers: &axum::http::HeaderMap) -> bool {
    method == Method::OPTIONS
        && headers.contains_key(axum::http::header::ORIGIN)
        && headers.contains_key(axum::http::header::ACCESS_CONTROL_REQUEST_METHOD)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn lists_parse_as_json_as_vllm_takes_them_or_comma_separated() {
        assert_eq!(
            parse_list(r#"["http://a.example", "http://b.example:8080"]"#).unwrap(),
            strings(&["http://a.example", "http://b.example:8080"])
        );
        assert_eq!(
            parse_list(" http://a.example, http://b.example ,").unwrap(),
            strings(&["http://a.example", "http://b.example"])
        );
        assert_eq!(parse_list(r#"["*"]"#).unwrap(), strings(&["*"]));
        assert_eq!(parse_list("[]").unwrap(), Vec::<String>::new());
        assert!(parse_list(r#"["a", 1]"#).is_err());
        assert!(parse_list("[a").is_err());
    }

    #[test]
    fn entries_that_cannot_be_header_values_are_refused_with_their_name() {
        let e = parse_origins("[\"http://a.example\\n\"]").unwrap_err();
        assert!(e.contains("not a valid origin"), "{e}");
        let e = parse_methods("GET,P OST").unwrap_err();
        assert!(e.contains("\"P OST\""), "{e}");
        let e = parse_headers("x-ok,bad:header").unwrap_err();
        assert!(e.contains("\"bad:header\""), "{e}");
        assert!(parse_headers("*").is_ok());
        let cfg = CorsConfig {
            allowed_headers: strings(&["bad header"]),
            ..CorsConfig::default()
        };
        assert!(cfg.layer().is_err());
    }

    /// tower-http panics when a layer with credentials answers `*`; every configuration,
    /// wildcards with credentials included, must build and apply without one.
    #[test]
    fn credentials_with_wildcards_build_a_usable_layer() {
        for creds in [false, true] {
            for list in [strings(&["*"]), strings(&["http://a.example", "*"]), vec![]] {
                let cfg = CorsConfig {
                    allowed_origins: list.clone(),
                    allowed_methods: list.clone(),
                    allowed_headers: list,
                    allow_credentials: creds,
                };
                let layer = cfg.layer().expect("a valid configuration");
                // Applying the layer is where tower-http checks its rules.
                let _ = tower::Layer::layer(&layer, ());
            }
        }
    }
}
