// A model's chat templates as Hugging Face ships them, and rendering a chat request with them the way
// transformers' apply_chat_template does (messages, tools, documents, add_generation_prompt, special tokens,
// extra keyword variables).
#pragma once

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "core/error.h"
#include "template/template.h"

namespace tern {

struct ChatTemplateSet {
  // Named templates; a single template is named "default". tokenizer_config.json may list several
  // ({name, template} objects), of which "tool_use" is chosen when the request has tools.
  std::map<std::string, ChatTemplate> templates;
  std::optional<std::string> bos_token, eos_token;

  // The template transformers would pick: "tool_use" when tools are given and present, else "default".
  Expected<const ChatTemplate*> select(bool has_tools) const;
  // `request`: an object with messages, optional tools, add_generation_prompt (default true), bos_token and
  // eos_token (defaulting to the model's), and any further keys, passed to the template as variables.
  Expected<std::string> render_request(const nlohmann::ordered_json& request) const;
};

// Reads DIR/chat_template.jinja if present, else the chat_template of DIR/tokenizer_config.json (a string or a
// list of {name, template}); special tokens come from tokenizer_config.json (strings or {"content": ...}).
Expected<ChatTemplateSet> chat_templates_load_model(const std::filesystem::path& dir);
// A single template file, named "default", with no special tokens.
Expected<ChatTemplateSet> chat_templates_load_file(const std::filesystem::path& path);

}  // namespace tern
