//! Chat template rendering checked against Python jinja2's rendering of the same templates
//! and conversations (fixtures written by `scripts/gen_chat_template_fixtures.py`).

use super::*;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/chat_templates");

fn load(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(format!("{FIXTURES}/{name}")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A case parsed the way the request parser parses messages: straight from the text into
/// template values, so keys keep the order they were sent in (as Python's dicts do).
#[derive(serde::Deserialize)]
struct Case {
    name: String,
    add_generation_prompt: bool,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    kwargs: Option<serde_json::Map<String, serde_json::Value>>,
}

#[derive(serde::Deserialize)]
struct Cases {
    cases: Vec<Case>,
}

/// A conversation rendered with the generation prompt, no tools and no extra variables.
fn generation_input(messages: &[Value]) -> ChatInput<'_> {
    ChatInput {
        messages,
        tools: None,
        add_generation_prompt: true,
        continue_final_message: false,
        extra: None,
    }
}

#[test]
fn renders_like_python_jinja2() {
    let spec = load("cases.json");
    let expected = load("expected.json");
    let special: Vec<(String, String)> = spec["special_tokens"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_owned()))
        .collect();
    let cases: Cases =
        serde_json::from_str(&std::fs::read_to_string(format!("{FIXTURES}/cases.json")).unwrap())
            .unwrap();
    let mut checked = 0;
    for entry in expected.as_array().unwrap() {
        let tname = entry["template"].as_str().unwrap();
        let path = format!("{FIXTURES}/{}", spec["templates"][tname].as_str().unwrap());
        let tmpl =
            ChatTemplate::new(&std::fs::read_to_string(&path).unwrap(), special.clone()).unwrap();
        let case = cases
            .cases
            .iter()
            .find(|c| c.name == entry["case"].as_str().unwrap())
            .unwrap();
        let input = ChatInput {
            messages: &case.messages,
            tools: case.tools.as_deref(),
            add_generation_prompt: case.add_generation_prompt,
            continue_final_message: false,
            extra: case.kwargs.as_ref(),
        };
        let got = tmpl.render(&input);
        match (entry.get("output"), entry.get("error")) {
            (Some(want), _) => assert_eq!(
                got.unwrap(),
                want.as_str().unwrap(),
                "{tname}/{}",
                entry["case"]
            ),
            (None, Some(err)) => {
                let e = got.unwrap_err();
                assert_eq!(e.status, hyper::StatusCode::BAD_REQUEST);
                assert!(e.message.contains(err.as_str().unwrap()), "{}", e.message);
            }
            _ => panic!("bad fixture"),
        }
        checked += 1;
    }
    assert!(checked >= 16, "{checked}");
}

#[test]
fn python_floats() {
    for (f, want) in [
        (1.0, "1.0"),
        (2.5, "2.5"),
        (1e20, "1e+20"),
        (1.5e-7, "1.5e-07"),
        (0.0001, "0.0001"),
        (-3.0, "-3.0"),
        (123456789.0, "123456789.0"),
    ] {
        assert_eq!(python_float(f), want, "{f}");
    }
}

#[test]
fn bad_messages_are_400s() {
    let tmpl = ChatTemplate::new("{{ messages }}", vec![]).unwrap();
    for bad in [
        r#"[1]"#,
        r#"[{"content": "x"}]"#,
        r#"[{"role": 5}]"#,
        r#"[{"role": "user", "content": 5}]"#,
        r#"[{"role": "user", "content": [{"type": "image_url"}]}]"#,
    ] {
        let messages: Vec<Value> = serde_json::from_str(bad).unwrap();
        let input = generation_input(&messages);
        let e = tmpl.render(&input).unwrap_err();
        assert_eq!(e.status, hyper::StatusCode::BAD_REQUEST, "{bad}");
        assert!(
            e.param.as_deref().unwrap().starts_with("messages["),
            "{bad}: {e:?}"
        );
    }
}

#[test]
fn strftime_now_formats_the_date() {
    let tmpl = ChatTemplate::new("{{ strftime_now('%Y') }}", vec![]).unwrap();
    let input = generation_input(&[]);
    let year: i32 = tmpl.render(&input).unwrap().parse().unwrap();
    assert!(year >= 2024);
}

#[test]
fn continue_final_message_cuts_after_the_last_content() {
    let src = std::fs::read_to_string(format!(
        "{FIXTURES}/../../../../engine-core/src/gen_model/llama31_chat_template.jinja"
    ))
    .unwrap();
    let tmpl = ChatTemplate::new(&src, vec![("bos_token".into(), "<s>".into())]).unwrap();
    let messages: Vec<Value> = serde_json::from_str(
        r#"[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]"#,
    )
    .unwrap();
    let input = ChatInput {
        messages: &messages,
        tools: None,
        add_generation_prompt: false,
        continue_final_message: true,
        extra: None,
    };
    assert!(tmpl
        .render(&input)
        .unwrap()
        .ends_with("<|start_header_id|>assistant<|end_header_id|>\n\nThe answer is"));
}

#[test]
fn template_from_tokenizer_config() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"bos_token": {"content": "<B>"}, "eos_token": "<E>", "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}"}]}"#,
    )
    .unwrap();
    let tmpl = ChatTemplate::from_model_dir(dir.path(), None)
        .unwrap()
        .unwrap();
    let messages: Vec<Value> =
        serde_json::from_str(r#"[{"role": "user", "content": "x"}]"#).unwrap();
    let input = generation_input(&messages);
    assert_eq!(tmpl.render(&input).unwrap(), "<B>x<E>");
    let empty = tempfile::tempdir().unwrap();
    assert!(ChatTemplate::from_model_dir(empty.path(), None)
        .unwrap()
        .is_none());
}

/// `--chat-template gemma3` picks the built-in Gemma 3 template (with the model's own special
/// tokens) when no file has that name; an unknown name lists the built-ins.
#[test]
fn builtin_templates_by_name() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"bos_token": "<bos>", "eos_token": "<eos>"}"#,
    )
    .unwrap();
    let tmpl = ChatTemplate::from_model_dir(dir.path(), Some(Path::new("gemma3")))
        .unwrap()
        .unwrap();
    let messages: Vec<Value> = serde_json::from_str(
        r#"[{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]"#,
    )
    .unwrap();
    let input = generation_input(&messages);
    assert_eq!(
        tmpl.render(&input).unwrap(),
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.\
         <end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    );
    let e = ChatTemplate::from_model_dir(dir.path(), Some(Path::new("gemma-9")))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("gemma-9") && e.contains("llama3.1, gemma3"),
        "{e}"
    );
}
