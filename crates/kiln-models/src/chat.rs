//! Chat templates (`tokenizer.chat_template` in GGUF, `chat_template` in
//! tokenizer_config.json), rendered with minijinja as transformers renders them with
//! Jinja2: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and
//! `raise_exception`, with Python string methods (`.strip()`, ...) available.

use kiln_core::{Error, Result};
use minijinja::{context, Environment};

#[derive(Clone, Debug, serde::Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

pub fn render(template: &str, messages: &[Message], bos: &str, eos: &str) -> Result<String> {
    let mut env = Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_template("chat", template)
        .map_err(|e| Error::format(format!("chat template: {e}")))?;
    let t = env
        .get_template("chat")
        .map_err(|e| Error::format(format!("chat template: {e}")))?;
    t.render(context! {
        messages => messages,
        add_generation_prompt => true,
        bos_token => bos,
        eos_token => eos,
    })
    .map_err(|e| Error::format(format!("chat template: {e}")))
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
