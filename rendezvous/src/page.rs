//! The status page `/`: one HTML file, its script and its style, embedded in the binary.
//!
//! The page holds no data: it reads the same `/v1` API as `rlaunch status`, with the bearer token
//! the user gives it (a browser cannot send one on navigation, so the page itself is served to
//! anyone; every job, node and root cause stays behind the token). It follows the selected job
//! through the watch long-poll, so a new round shows within one request. Served with a content
//! security policy that allows only these files and requests to this origin: whatever a node id
//! or a stack line holds, it is written as text (`textContent`), never as markup.

use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

const INDEX_HTML: &str = include_str!("page/index.html");
const PAGE_JS: &str = include_str!("page/page.js");
const PAGE_CSS: &str = include_str!("page/page.css");

/// Scripts, styles and requests from this origin only; no frames, no plugins, no inline code.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn asset(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::X_FRAME_OPTIONS, "DENY"),
            // A new binary's page is taken at once (the files are small).
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
}

/// `/`, `/page.js`, `/page.css`.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/", get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }))
        .route("/page.js", get(|| async { asset("text/javascript; charset=utf-8", PAGE_JS) }))
        .route("/page.css", get(|| async { asset("text/css; charset=utf-8", PAGE_CSS) }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_loads_only_its_own_files_and_writes_data_as_text() {
        // What the CSP allows must be what the page uses: its script and style by path, no
        // inline code (which the policy would block).
        assert!(INDEX_HTML.contains(r#"<script src="page.js" defer></script>"#));
        assert!(INDEX_HTML.contains(r#"<link rel="stylesheet" href="page.css">"#));
        assert!(!INDEX_HTML.contains("<script>"), "inline script");
        assert!(!INDEX_HTML.contains("style="), "inline style");
        let handler = INDEX_HTML.split(" on").skip(1).any(|rest| {
            let name: String = rest.chars().take_while(|c| c.is_ascii_alphabetic()).collect();
            !name.is_empty() && rest[name.len()..].starts_with('=')
        });
        assert!(!handler, "inline event handler");
        for risky in ["innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("] {
            assert!(!PAGE_JS.contains(risky), "page.js uses {risky}");
        }
        // The token goes only to this origin's API, in a header.
        assert!(PAGE_JS.contains("headers.Authorization = 'Bearer ' + st.token"));
        assert!(!PAGE_JS.contains("localStorage"), "the token is kept per tab (sessionStorage)");
    }
}
