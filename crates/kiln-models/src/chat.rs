//! Chat templates (`tokenizer.chat_template` in GGUF, `chat_template` in
//! tokenizer_config.json), rendered with minijinja as transformers renders them with
//! Jinja2: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and
//! `raise_exception`, with Python string methods (`.strip()`, ...) available.
//!
//! A template comes with a downloaded model: it is untrusted code. Rendering is bounded
//! in instructions (minijinja's fuel) and in bytes: what the template writes, everywhere
//! it writes it (`{{ }}` inside `{% set %}` blocks and macros included), and what the
//! filters and methods that multiply text (`join`, `replace`, `indent`) would build,
//! checked before they build it; and filters that make a list of a string's characters
//! or a sequence's items take at most [`MAX_ITEMS`].

use kiln_core::{Error, Result};
use minijinja::value::{Kwargs, Rest, StringInput, Value};
use minijinja::{context, Environment, ErrorKind, State};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// Instructions one render may run. Published templates take a few hundred per message;
/// this allows thousands of messages and stops a runaway loop in about a second.
const FUEL: u64 = 5_000_000;

/// Bytes a render may write in all, beyond a multiple of what it is given.
const OUTPUT_BASE: usize = 4 << 20;

/// The longest string or sequence a filter or method may turn into a list: a list holds
/// tens of bytes per item, and `'x' * 99999999 | list` would otherwise take gigabytes.
const MAX_ITEMS: usize = 1 << 20;

/// Filters that build a sequence with an item per item (or character) of their input.
fn listing_filters() -> Vec<(&'static str, Value)> {
    use minijinja::filters;
    vec![
        ("list", Value::from_function(filters::list)),
        ("batch", Value::from_function(filters::batch)),
        ("slice", Value::from_function(filters::slice)),
        ("sort", Value::from_function(filters::sort)),
        ("map", Value::from_function(filters::map)),
        ("items", Value::from_function(filters::items)),
        ("chain", Value::from_function(filters::chain)),
        ("zip", Value::from_function(filters::zip)),
        ("split", Value::from_function(filters::split)),
        ("lines", Value::from_function(filters::lines)),
    ]
}

/// Python string methods that do the same.
const LISTING_METHODS: &[&str] = &["split", "splitlines", "rsplit"];

/// Refuses to turn `v` into a list when it is too long (its length in bytes for a string,
/// an upper bound on its characters; unknown for a lazy iterator, which range() bounds).
fn check_items(v: &Value, what: &str) -> std::result::Result<(), minijinja::Error> {
    let len = v.as_str().map(str::len).or_else(|| v.len()).unwrap_or(0);
    if len > MAX_ITEMS {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("{what} of a value with {len} items; at most {MAX_ITEMS} are allowed"),
        ));
    }
    Ok(())
}

/// Bytes of text a render may produce: its output, the output of its `{% set %}` blocks and
/// macros, and the results of `join`, `replace` and `indent`, counted together.
#[derive(Clone)]
struct Budget {
    limit: usize,
    used: Arc<AtomicUsize>,
}

impl Budget {
    /// Takes `bytes` from the budget, or fails once it is spent.
    fn take(&self, bytes: usize) -> std::result::Result<(), minijinja::Error> {
        let used = self
            .used
            .fetch_add(bytes, Ordering::Relaxed)
            .saturating_add(bytes);
        if used > self.limit {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                self.exceeded_message(),
            ));
        }
        Ok(())
    }

    fn exceeded_message(&self) -> String {
        format!(
            "the template builds more than {} bytes of text (4 MiB plus 8 times the \
             messages and template)",
            self.limit
        )
    }
}

fn displayed_len(v: &Value) -> usize {
    v.as_str().map_or_else(|| v.to_string().len(), str::len)
}

/// The length of `items` joined by `sep`, without building it.
fn joined_len(items: &Value, sep: usize) -> std::result::Result<usize, minijinja::Error> {
    let mut total = 0usize;
    for (i, item) in items.try_iter()?.enumerate() {
        total = total
            .saturating_add(displayed_len(&item))
            .saturating_add(if i > 0 { sep } else { 0 });
    }
    Ok(total)
}

/// The length of `s` with every `from` replaced by `to`, without building it.
fn replaced_len(s: &str, from: &str, to: &str) -> usize {
    // Python and minijinja insert `to` around every character for an empty `from`.
    let count = if from.is_empty() {
        s.chars().count() + 1
    } else {
        s.matches(from).count()
    };
    s.len().saturating_add(count.saturating_mul(to.len()))
}

fn environment(budget: &Budget) -> Environment<'static> {
    let mut env = Environment::new();
    env.set_fuel(Some(FUEL));
    let b = budget.clone();
    env.set_formatter(move |out, state, value| {
        b.take(displayed_len(value))?;
        minijinja::escape_formatter(out, state, value)
    });
    let b = budget.clone();
    env.set_unknown_method_callback(move |state, value, method, args| {
        if LISTING_METHODS.contains(&method) {
            check_items(value, &format!(".{method}()"))?;
        }
        if let Some(s) = value.as_str() {
            match (method, args) {
                ("join", [items]) => b.take(joined_len(items, s.len())?)?,
                ("replace", [from, to, ..]) => {
                    b.take(replaced_len(s, &from.to_string(), &to.to_string()))?
                }
                _ => {}
            }
        }
        minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
    });
    let b = budget.clone();
    env.add_filter(
        "join",
        move |state: &State, value: &Value, sep: Option<StringInput>| {
            b.take(joined_len(
                value,
                sep.as_ref().map_or(0, |s| s.as_str().len()),
            )?)?;
            minijinja::filters::join(state, value, sep)
        },
    );
    let b = budget.clone();
    env.add_filter(
        "replace",
        move |state: &State, s: StringInput, from: StringInput, to: StringInput| {
            b.take(replaced_len(s.as_str(), from.as_str(), to.as_str()))?;
            minijinja::filters::replace(state, s, from, to)
        },
    );
    let b = budget.clone();
    env.add_filter(
        "indent",
        move |s: StringInput,
              width: Option<usize>,
              first: Option<bool>,
              blank: Option<bool>,
              kwargs: Kwargs| {
            let lines = s.as_str().lines().count() + 1;
            let width = width.unwrap_or(4);
            b.take(s.as_str().len().saturating_add(lines.saturating_mul(width)))?;
            minijinja::filters::indent(s, Some(width), first, blank, kwargs)
        },
    );
    for (name, builtin) in listing_filters() {
        env.add_filter(name, move |state: &State, args: Rest<Value>| {
            if let Some(input) = args.first() {
                check_items(input, &format!("|{name}"))?;
            }
            builtin.call(state, &args)
        });
    }
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env
}

pub fn render(template: &str, messages: &[Message], bos: &str, eos: &str) -> Result<String> {
    let given: usize = messages
        .iter()
        .map(|m| m.role.len() + m.content.len())
        .sum::<usize>()
        + bos.len()
        + eos.len()
        + template.len();
    let budget = Budget {
        limit: OUTPUT_BASE.saturating_add(given.saturating_mul(8)),
        used: Arc::new(AtomicUsize::new(0)),
    };
    let mut env = environment(&budget);
    let fail = |e: minijinja::Error| {
        let what = match e.kind() {
            ErrorKind::OutOfFuel => format!(
                "the template ran more than {FUEL} instructions (a loop that does not end?)"
            ),
            _ => e.to_string(),
        };
        Error::format(format!("chat template: {what}"))
    };
    env.add_template("chat", template).map_err(fail)?;
    let t = env.get_template("chat").map_err(fail)?;
    let mut out = BoundedText {
        text: Vec::new(),
        limit: budget.limit,
        overflowed: false,
    };
    let rendered = t.render_captured_to(
        context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => bos,
            eos_token => eos,
        },
        &mut out,
    );
    if out.overflowed {
        return Err(Error::format(format!(
            "chat template: {}",
            budget.exceeded_message()
        )));
    }
    rendered.map_err(fail)?;
    String::from_utf8(out.text).map_err(|_| Error::format("chat template: the output is not UTF-8"))
}

/// The rendered text. Template text outside `{{ }}` reaches only this writer, so the
/// output is bounded here as well as in the budget.
struct BoundedText {
    text: Vec<u8>,
    limit: usize,
    /// Set when a write would pass the limit (minijinja reports only an I/O error).
    overflowed: bool,
}

impl std::io::Write for BoundedText {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + buf.len() > self.limit {
            self.overflowed = true;
            return Err(std::io::Error::other("the output is too long"));
        }
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_a_chatml_and_a_llama2_style_template() {
        let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        let msgs = [Message {
            role: "user".into(),
            content: "Hi".into(),
        }];
        assert_eq!(
            render(chatml, &msgs, "<s>", "</s>").unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let llama2 = "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content.strip() }} [/INST]{% else %}{{ raise_exception('only user turns') }}{% endif %}{% endfor %}";
        let msgs = [Message {
            role: "user".into(),
            content: "  Hello  ".into(),
        }];
        assert_eq!(
            render(llama2, &msgs, "<s>", "</s>").unwrap(),
            "<s>[INST] Hello [/INST]"
        );
        let sys = [Message {
            role: "system".into(),
            content: "x".into(),
        }];
        let err = render(llama2, &sys, "<s>", "</s>").unwrap_err().to_string();
        assert!(err.contains("only user turns"), "{err}");
        assert!(render("{% for %}", &msgs, "", "").is_err());
    }
}
