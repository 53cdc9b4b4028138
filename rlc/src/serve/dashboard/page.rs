//! What the dashboard's pages share beyond [`super`]'s helpers: the page that says only what
//! went wrong (an unknown run or bucket, the store down), in the bucket and run pages' style.

use maud::{html, DOCTYPE};

use super::chart::CHART_CSS;
use super::CSS;

/// A page that says only what went wrong (an unknown run or bucket, the store down).
pub fn error_page(title: &str, message: &str) -> String {
    html! {
        (DOCTYPE)
        html lang="en" {
            (super::head(&format!("RLC — {title}"), &[CSS, CHART_CSS]))
            body {
                header {
                    h1 { (title) }
                    p { a href="/" { "← all buckets" } }
                }
                main {
                    section class="notice" id="problem" {
                        h2 { "Not found or not loaded" }
                        p { (super::prose(message)) }
                    }
                }
            }
        }
    }
    .into_string()
}
