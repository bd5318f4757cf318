//! `#[test]` and `#[test(needs)]` for ninfer-testkit: the function stays as written and a
//! record of it (module path, name, what it needs, how to run it) is added to
//! `ninfer_testkit::TESTS` at link time. A crate that imports this attribute under the name
//! `test` (`#[macro_use] extern crate ninfer_testkit;` at its root) shadows the built-in
//! one everywhere, so ordinary `#[test]` functions need no edit.
//!
//! Written on `proc_macro` alone: the only thing read from the item is its name.

use proc_macro::{Delimiter, TokenStream, TokenTree};

/// What a test may say it needs: `#[test]` (nothing), `#[test(prepared)]`, `#[test(gxx)]`,
/// `#[test(nvrtc)]`, `#[test(gpu)]`.
const NEEDS: [(&str, &str); 5] = [
    ("nothing", "Nothing"),
    ("prepared", "Prepared"),
    ("gxx", "Gxx"),
    ("nvrtc", "Nvrtc"),
    ("gpu", "Gpu"),
];

#[proc_macro_attribute]
pub fn test(attr: TokenStream, item: TokenStream) -> TokenStream {
    match expand(attr, item.clone()) {
        Ok(registration) => {
            let mut out = item;
            out.extend(registration);
            out
        }
        Err(msg) => format!("::core::compile_error!({msg:?});").parse().unwrap(),
    }
}

fn expand(attr: TokenStream, item: TokenStream) -> Result<TokenStream, String> {
    let needs = match attr.into_iter().collect::<Vec<_>>().as_slice() {
        [] => "Nothing",
        [TokenTree::Ident(i)] => {
            let word = i.to_string();
            NEEDS
                .iter()
                .find(|(w, _)| *w == word)
                .map(|(_, v)| *v)
                .ok_or_else(|| {
                    let valid: Vec<&str> = NEEDS.iter().map(|(w, _)| *w).collect();
                    format!("#[test({word})]: expected one of {}", valid.join(", "))
                })?
        }
        _ => return Err("#[test(..)] takes one word: what the test needs".into()),
    };
    let tokens: Vec<TokenTree> = item.into_iter().collect();
    let mut name = None;
    for pair in tokens.windows(2) {
        if let (TokenTree::Ident(kw), TokenTree::Ident(id)) = (&pair[0], &pair[1]) {
            if kw.to_string() == "fn" {
                name = Some(id.to_string());
                break;
            }
        }
    }
    let name = name.ok_or("#[test] goes on a function")?;
    if let Some(TokenTree::Group(g)) = tokens
        .iter()
        .find(|t| matches!(t, TokenTree::Group(g) if g.delimiter() == Delimiter::Parenthesis))
    {
        if !g.stream().is_empty() {
            return Err(format!("#[test] fn {name}: a test takes no arguments"));
        }
    }
    Ok(format!(
        "#[::ninfer_testkit::linkme::distributed_slice(::ninfer_testkit::TESTS)]
         #[linkme(crate = ::ninfer_testkit::linkme)]
         #[allow(non_upper_case_globals)]
         static __ninfer_test_{name}: ::ninfer_testkit::Test = ::ninfer_testkit::Test {{
             module: ::core::module_path!(),
             name: {name:?},
             needs: ::ninfer_testkit::Needs::{needs},
             run: || ::ninfer_testkit::Outcome::check({name}()),
         }};"
    )
    .parse()
    .unwrap())
}
