#include "template/template.h"

#include "template/ast.h"
#include "template/renderer.h"

namespace tern {

namespace {

Error template_error(std::string_view name, const jinja::TemplateFailure& f) {
  if (f.line > 0) return Error{fmt::format("template '{}', line {}: {}", name, f.line, f.what())};
  return Error{fmt::format("template '{}': {}", name, f.what())};
}

}  // namespace

Expected<ChatTemplate> ChatTemplate::parse(std::string_view source, std::string_view name) {
  ChatTemplate t;
  t.name_ = std::string(name);
  try {
    t.program_ = jinja::parse_program(source);
  } catch (const jinja::TemplateFailure& f) {
    return tl::unexpected(template_error(name, f));
  }
  return t;
}

Expected<std::string> ChatTemplate::render(const nlohmann::ordered_json& context) const {
  if (!context.is_object()) return make_error("template '{}': the render context must be a JSON object", name_);
  try {
    jinja::Renderer renderer(program_);
    return renderer.render(jinja::Value::from_json(context));
  } catch (const jinja::TemplateFailure& f) {
    return tl::unexpected(template_error(name_, f));
  }
}

}  // namespace tern
