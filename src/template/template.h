// Chat templates: a Jinja2 engine whose output is byte-identical to Python Jinja2 as transformers sets it up
// (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols, {% generation %}, its tojson,
// raise_exception and strftime_now).
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "core/error.h"

namespace tern {

namespace jinja {
struct Program;
}

class ChatTemplate {
 public:
  // Syntax errors, unknown filters and unknown tests give an Error naming the template and line.
  static Expected<ChatTemplate> parse(std::string_view source, std::string_view name = "chat_template");
  // `context` must be an object; its keys become template variables (messages, tools, add_generation_prompt,
  // bos_token, ...). Runtime errors (raise_exception, a missing method, a type error) name the template line.
  Expected<std::string> render(const nlohmann::ordered_json& context) const;

  const std::string& name() const { return name_; }

 private:
  std::string name_;
  std::shared_ptr<const jinja::Program> program_;
};

}  // namespace tern
