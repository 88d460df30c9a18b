#include "template/model_template.h"

#include <fstream>
#include <sstream>

#include "core/json_parse.h"

namespace tern {
namespace {

using json = nlohmann::ordered_json;

Expected<std::string> read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error("{}: cannot open file", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Special tokens are plain strings or AddedToken objects {"content": ...}; null means absent.
Expected<std::optional<std::string>> read_token(const json& config, const char* key, const std::string& where) {
  if (!config.contains(key) || config[key].is_null()) return std::optional<std::string>();
  const json& t = config[key];
  if (t.is_string()) return std::optional<std::string>(t.get<std::string>());
  if (t.is_object() && t.contains("content") && t["content"].is_string())
    return std::optional<std::string>(t["content"].get<std::string>());
  return make_error("{}: field '{}' must be a string or an object with a string 'content'", where, key);
}

Expected<void> add_template(ChatTemplateSet& set, const std::string& name, const std::string& source,
                            const std::string& where) {
  auto parsed = ChatTemplate::parse(source, where + (name == "default" ? "" : ":" + name));
  if (!parsed) return tl::unexpected(parsed.error());
  set.templates.insert_or_assign(name, std::move(*parsed));
  return {};
}

Expected<void> read_config_templates(ChatTemplateSet& set, const json& config, const std::string& where) {
  if (!config.contains("chat_template") || config["chat_template"].is_null())
    return make_error("{}: no 'chat_template' field and no chat_template.jinja next to it", where);
  const json& ct = config["chat_template"];
  if (ct.is_string()) return add_template(set, "default", ct.get<std::string>(), where);
  if (!ct.is_array()) return make_error("{}: 'chat_template' must be a string or a list of {{name, template}}", where);
  for (const json& entry : ct) {
    if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() || !entry.contains("template") ||
        !entry["template"].is_string())
      return make_error("{}: each 'chat_template' entry needs string fields 'name' and 'template'", where);
    TERN_TRY(add_template(set, entry["name"].get<std::string>(), entry["template"].get<std::string>(), where));
  }
  return {};
}

}  // namespace

Expected<ChatTemplateSet> chat_templates_load_model(const std::filesystem::path& dir) {
  ChatTemplateSet set;
  const std::filesystem::path config_path = dir / "tokenizer_config.json";
  const std::filesystem::path jinja_path = dir / "chat_template.jinja";
  json config = json::object();
  if (std::filesystem::exists(config_path)) {
    TERN_ASSIGN_OR_RETURN(std::string text, read_text(config_path));
    auto parsed = json_parse_untrusted_ordered(text);
    if (!parsed) return make_error("{}: not valid JSON: {}", config_path.string(), parsed.error().message);
    config = std::move(*parsed);
    if (!config.is_object()) return make_error("{}: not a JSON object", config_path.string());
    TERN_ASSIGN_OR_RETURN(set.bos_token, read_token(config, "bos_token", config_path.string()));
    TERN_ASSIGN_OR_RETURN(set.eos_token, read_token(config, "eos_token", config_path.string()));
  }
  if (std::filesystem::exists(jinja_path)) {
    TERN_ASSIGN_OR_RETURN(std::string source, read_text(jinja_path));
    TERN_TRY(add_template(set, "default", source, jinja_path.string()));
  } else if (std::filesystem::exists(config_path)) {
    TERN_TRY(read_config_templates(set, config, config_path.string()));
  } else {
    return make_error("{}: neither chat_template.jinja nor tokenizer_config.json found", dir.string());
  }
  return set;
}

Expected<ChatTemplateSet> chat_templates_load_file(const std::filesystem::path& path) {
  ChatTemplateSet set;
  TERN_ASSIGN_OR_RETURN(std::string source, read_text(path));
  TERN_TRY(add_template(set, "default", source, path.string()));
  return set;
}

Expected<const ChatTemplate*> ChatTemplateSet::select(bool has_tools) const {
  if (has_tools)
    if (auto it = templates.find("tool_use"); it != templates.end()) return &it->second;
  if (auto it = templates.find("default"); it != templates.end()) return &it->second;
  std::string names;
  for (const auto& [name, t] : templates) names += (names.empty() ? "" : ", ") + name;
  return make_error("no 'default' chat template (available: {})", names);
}

Expected<std::string> ChatTemplateSet::render_request(const nlohmann::ordered_json& request) const {
  if (!request.is_object()) return make_error("the request must be a JSON object");
  if (!request.contains("messages") || !request["messages"].is_array())
    return make_error("the request needs a 'messages' array");
  json context = json::object();
  context["messages"] = request["messages"];
  context["tools"] = request.contains("tools") ? request["tools"] : json(nullptr);
  context["documents"] = request.contains("documents") ? request["documents"] : json(nullptr);
  context["add_generation_prompt"] = request.contains("add_generation_prompt") ? request["add_generation_prompt"] : json(true);
  if (bos_token) context["bos_token"] = *bos_token;
  if (eos_token) context["eos_token"] = *eos_token;
  for (const auto& [key, value] : request.items()) context[key] = value;  // bos/eos overrides and extra variables
  TERN_ASSIGN_OR_RETURN(const ChatTemplate* t, select(!context["tools"].is_null()));
  return t->render(context);
}

}  // namespace tern
