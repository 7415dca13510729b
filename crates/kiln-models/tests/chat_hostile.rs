//! Chat templates are untrusted code from a downloaded model: hostile ones end with a
//! clear error, quickly and without taking memory, and ordinary ones still render.

use kiln_models::chat::{render, Message};
use std::time::{Duration, Instant};

fn user(content: &str) -> Vec<Message> {
    vec![Message {
        role: "user".into(),
        content: content.into(),
    }]
}

/// Renders `template`, expecting an error that mentions `expect`, within `limit`.
fn refused(template: &str, expect: &str) -> String {
    let start = Instant::now();
    let err = render(template, &user("Hi"), "<s>", "</s>")
        .map(|out| format!("rendered {} bytes", out.len()))
        .unwrap_or_else(|e| e.to_string());
    let took = start.elapsed();
    assert!(
        err.starts_with("chat template: ") && err.contains(expect),
        "{template}: {err}"
    );
    // Generous for a loaded CI machine; unbounded, these take minutes or abort.
    assert!(took < Duration::from_secs(5), "{template}: {took:?}");
    err
}

#[test]
fn endless_loops_run_out_of_fuel() {
    for t in [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
        "{% macro f(n) %}{% for i in range(100000) %}{% endfor %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    ] {
        let err = refused(t, "");
        assert!(
            err.contains("instructions") || err.contains("recursion"),
            "{t}: {err}"
        );
    }
}

#[test]
fn text_that_multiplies_is_refused_before_it_is_built() {
    // Raw text repeated into the output: only the writer sees it.
    let raw = format!(
        "{{% for i in range(99999) %}}{}{{% endfor %}}",
        "x".repeat(100)
    );
    let err = refused(&raw, "");
    assert!(
        err.starts_with("chat template: the template builds more than"),
        "{err}"
    );
    for t in [
        // Repetition and joins that would write gigabytes.
        "{% for i in range(99999) %}{{ 'x' * 99999 }}{% endfor %}",
        "{{ range(99999) | join('x' * 99999) }}",
        "{{ ('x' * 99999).join(range(99999) | map('string')) }}",
        "{{ ('x' * 9999999) | replace('x', 'yyyyyyyyyyyyyyyyy') }}",
        "{{ ('x' * 9999999) | replace('', 'yyyy') }}",
        "{{ ('x' * 9999999).replace('x', 'yyyyyyyyyyyyyyyyy') }}",
        "{{ ('\n' * 9999999) | indent(99999) }}",
        // Raw text repeated into the output.
        "{% for i in range(99999) %}xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx{% endfor %}",
        // Output captured by set blocks and macros counts too.
        "{% set s %}{% for i in range(99999) %}{{ 'x' * 9999 }}{% endfor %}{% endset %}",
        "{% macro m() %}{{ 'x' * 9999999 }}{% endmacro %}{% for i in range(999) %}{% set _ = m() %}{% endfor %}",
    ] {
        refused(t, "bytes");
    }
}

#[test]
fn huge_lists_are_refused_before_they_are_built() {
    for t in [
        "{{ ('x' * 99999999) | list | length }}",
        "{{ ('x ' * 49999999).split() | length }}",
        "{{ ('x\n' * 49999999) | lines | length }}",
        "{{ ('x' * 99999999) | batch(1) | length }}",
        "{{ ('x' * 99999999) | map('upper') | length }}",
    ] {
        refused(t, "items; at most 1048576 are allowed");
    }
}

#[test]
fn ordinary_templates_and_long_messages_still_render() {
    let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n";
    let long = "word ".repeat(200_000);
    let out = render(chatml, &user(&long), "", "").unwrap();
    assert!(out.contains(&long));
    let joined = render(
        "{{ messages | map(attribute='content') | join(', ') }}",
        &user("a"),
        "",
        "",
    )
    .unwrap();
    assert_eq!(joined, "a");
    assert_eq!(
        render("{{ 'ab' | replace('a', 'x') }}", &user(""), "", "").unwrap(),
        "xb"
    );
    assert_eq!(
        render("{{ 'a\nb' | indent(2) }}", &user(""), "", "").unwrap(),
        "a\n  b"
    );
    assert_eq!(
        render("{{ '-'.join(['a', 'b']) }}", &user(""), "", "").unwrap(),
        "a-b"
    );
}
