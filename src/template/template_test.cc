// Chat-template tests against golden data written by Python Jinja2 3.1.6 set up as transformers does
// (tools/template_golden/make_golden.py): real templates over conversations, and a semantics micro-suite.
#include "template/template.h"

#include <gtest/gtest.h>

#include <malloc.h>

#include <filesystem>
#include <fstream>
#include <sstream>

namespace tern {
namespace {

using json = nlohmann::ordered_json;

const std::filesystem::path kData = std::filesystem::path(TERN_SOURCE_DIR) / "tests/data/templates";

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json read_json(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) ADD_FAILURE() << "cannot open " << path;
  return json::parse(in);
}

// The line number our error message names ("template 'x', line N: ..."), or -1.
int error_line_of(const std::string& message) {
  const size_t at = message.find(", line ");
  if (at == std::string::npos) return -1;
  return std::stoi(message.substr(at + 7));
}

// Loads a real template: the npm tokenizer_config.json's chat_template, or a committed .jinja file.
std::string load_real_template(const std::string& relative_path) {
  const std::filesystem::path path = std::filesystem::path(TERN_SOURCE_DIR) / relative_path;
  if (!std::filesystem::exists(path)) {
    ADD_FAILURE() << "missing " << path << ": run scripts/fetch_test_assets.sh to install the npm test assets";
    return {};
  }
  if (path.extension() == ".json") return read_json(path)["chat_template"].get<std::string>();
  return read_file(path);
}

void expect_case(const json& c, const std::string& source, const json& context, const std::string& label) {
  SCOPED_TRACE(label);
  auto tmpl = ChatTemplate::parse(source, "case");
  Expected<std::string> out = tmpl ? tmpl->render(context) : Expected<std::string>(tl::unexpected(tmpl.error()));
  if (c.contains("text")) {
    ASSERT_TRUE(out) << "Python rendered it, we failed: " << out.error().message;
    EXPECT_EQ(*out, c["text"].get<std::string>());
    return;
  }
  ASSERT_FALSE(out) << "Python failed with '" << c["error"].get<std::string>() << "', we rendered: " << *out;
  if (c["error_type"] == "TemplateError") {  // raise_exception: the message must come through
    EXPECT_NE(out.error().message.find(c["error"].get<std::string>()), std::string::npos) << out.error().message;
  }
  if (!c["error_line"].is_null()) {
    EXPECT_EQ(error_line_of(out.error().message), c["error_line"].get<int>())
        << "ours: " << out.error().message << "\nPython: " << c["error"].get<std::string>();
  }
}

TEST(TemplateGolden, RealTemplatesMatchPythonJinja2) {
  const json golden = read_json(kData / "golden.json");
  ASSERT_GE(golden.size(), 100u);
  std::map<std::string, std::string> sources;
  for (const json& c : golden) {
    const std::string name = c["template"].get<std::string>();
    if (!sources.count(name)) sources[name] = load_real_template(c["template_path"].get<std::string>());
    ASSERT_FALSE(sources[name].empty()) << name;
    expect_case(c, sources[name], c["context"], name + " / " + c["conversation"].get<std::string>());
  }
  EXPECT_EQ(sources.size(), 7u);
}

TEST(TemplateGolden, SemanticsMatchPythonJinja2) {
  const json golden = read_json(kData / "semantics_golden.json");
  const json& cases = golden["cases"];
  ASSERT_GE(cases.size(), 200u);
  for (const json& c : cases) {
    json context = golden["context"];
    if (c.contains("context"))
      for (const auto& [k, v] : c["context"].items()) context[k] = v;
    expect_case(c, c["template"].get<std::string>(), context, c["template"].get<std::string>());
  }
}

// Found by template_fuzz: a slice among several subscripts reached the renderer without its operand (a null
// dereference). Single slices and tuple subscripts still work.
TEST(TemplateErrors, SliceAmongSeveralSubscriptsIsAnError) {
  for (const char* source : {"{{ x[1, 2:3] }}", "{{ x[1:2, 3] }}", "{{ true [1,2,3-n:a:b] }}"}) {
    auto t = ChatTemplate::parse(source);
    ASSERT_FALSE(t) << source;
    EXPECT_NE(t.error().message.find("a slice cannot be one of several subscripts"), std::string::npos)
        << t.error().message;
  }
  auto ok = ChatTemplate::parse("{{ x[1:3] }}{{ x[::2] }}{{ d[1, 2] }}");
  ASSERT_TRUE(ok) << ok.error().message;
  auto out = ok->render(nlohmann::ordered_json{{"x", {1, 2, 3, 4}}, {"d", nlohmann::ordered_json::object()}});
  ASSERT_TRUE(out) << out.error().message;
  EXPECT_EQ(*out, "[2, 3][1, 3]");  // Python Jinja2's output (d[(1, 2)] is undefined: empty)
}

TEST(TemplateErrors, SyntaxErrorNamesTemplateAndLine) {
  auto t = ChatTemplate::parse("line one\n{% if x %}\n{{ 1 + }}\n{% endif %}", "my_template");
  ASSERT_FALSE(t);
  EXPECT_NE(t.error().message.find("template 'my_template', line 3"), std::string::npos) << t.error().message;
}

TEST(TemplateErrors, RaiseExceptionMessageAndLine) {
  auto t = ChatTemplate::parse("a\nb\n{{ raise_exception('Conversation roles must alternate') }}");
  ASSERT_TRUE(t) << t.error().message;
  auto r = t->render(json::object());
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("Conversation roles must alternate"), std::string::npos) << r.error().message;
  EXPECT_EQ(error_line_of(r.error().message), 3) << r.error().message;
}

TEST(TemplateErrors, UnknownFilterIsAParseError) {
  auto t = ChatTemplate::parse("{{ 'x' }}\n{{ messages | frobnicate }}");
  ASSERT_FALSE(t);
  EXPECT_NE(t.error().message.find("frobnicate"), std::string::npos) << t.error().message;
  EXPECT_EQ(error_line_of(t.error().message), 2) << t.error().message;
}

TEST(TemplateErrors, MissingMethodIsARuntimeErrorWithLine) {
  auto t = ChatTemplate::parse("{% for m in messages %}\n{{ m.content.frobnicate() }}\n{% endfor %}");
  ASSERT_TRUE(t) << t.error().message;
  auto r = t->render({{"messages", {{{"role", "user"}, {"content", "hi"}}}}});
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("frobnicate"), std::string::npos) << r.error().message;
  EXPECT_EQ(error_line_of(r.error().message), 2) << r.error().message;
}

TEST(TemplateErrors, RunawayRecursionAndLoopsAreStopped) {
  auto rec = ChatTemplate::parse("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
  ASSERT_TRUE(rec) << rec.error().message;
  auto r = rec->render(json::object());
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("recursion"), std::string::npos) << r.error().message;

  // 100000^2 iterations: stopped by the step limit long before it finishes.
  auto loops = ChatTemplate::parse("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}");
  ASSERT_TRUE(loops) << loops.error().message;
  auto l = loops->render(json::object());
  ASSERT_FALSE(l);
  EXPECT_NE(l.error().message.find("limit"), std::string::npos) << l.error().message;
}

TEST(TemplateErrors, ContextMustBeAnObject) {
  auto t = ChatTemplate::parse("x");
  ASSERT_TRUE(t);
  EXPECT_FALSE(t->render(json::array()));
}

}  // namespace
}  // namespace tern

namespace tern {
namespace {

// A hostile template nests deeper than any real one: an error naming the limit, not a stack overflow.
TEST(TemplateErrors, DeepNestingIsAnErrorNotACrash) {
  const std::vector<std::string> hostile{
      "{{ " + std::string(20000, '(') + "1" + std::string(20000, ')') + " }}",
      "{{ " + [] { std::string s; for (int i = 0; i < 20000; ++i) s += "not "; return s; }() + "x }}",
      "{{ " + std::string(20000, '-') + "1 }}",
      "{{ " + std::string(20000, '[') + "1" + std::string(20000, ']') + " }}",
      [] { std::string s; for (int i = 0; i < 20000; ++i) s += "{% if x %}"; return s; }()};
  for (const std::string& text : hostile) {
    auto t = ChatTemplate::parse(text, "hostile");
    ASSERT_FALSE(t) << text.substr(0, 40);
    EXPECT_NE(t.error().message.find("deeper than 400 levels"), std::string::npos) << t.error().message;
  }
  // Nesting a real template could have still parses and renders as Python Jinja2 does.
  auto ok = ChatTemplate::parse("{{ " + std::string(50, '(') + "1 + 2" + std::string(50, ')') + " }}");
  ASSERT_TRUE(ok) << ok.error().message;
  auto r = ok->render(nlohmann::ordered_json::object());
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(*r, "3");
}

}  // namespace
}  // namespace tern

namespace tern {
namespace {

std::string render_error(const std::string& text) {
  auto t = ChatTemplate::parse(text, "hostile");
  if (!t) return t.error().message;
  auto r = t->render(nlohmann::ordered_json::object());
  return r ? std::string() : r.error().message;
}

std::string render_ok(const std::string& text) {
  auto t = ChatTemplate::parse(text, "ok");
  EXPECT_TRUE(t) << t.error().message;
  if (!t) return {};
  auto r = t->render(nlohmann::ordered_json::object());
  EXPECT_TRUE(r) << r.error().message;
  return r ? *r : std::string();
}

// Every operation that grows a string checks the size it would build (64 MiB at most), and format widths and
// precisions are bounded (2^20): a hostile template or request value is an error, not gigabytes of memory.
// A macro lives in the scope it captures (found by template_fuzz: every render of a template with a macro leaked
// its scopes). Rendering such templates many times must not grow the heap.
TEST(TemplateMemory, MacrosAndCallersDoNotLeakTheirScopes) {
  const char* sources[] = {
      "{% macro f(a, b=2) %}{{ a * b }}{% endmacro %}{{ f(3) }}",
      "{% set ns = namespace(m=none) %}{% for x in [1, 2] %}{% macro g() %}g{{ 1 + 1 }}{% endmacro %}"
      "{% set ns.m = g %}{% endfor %}{{ ns.m() }}",
      "{% macro w() %}[{{ caller() }}]{% endmacro %}{% call w() %}in{% endcall %}",
  };
  const char* expected[] = {"6", "g2", "[in]"};  // Python Jinja2's output
  for (int i = 0; i < 3; ++i) {
    auto t = ChatTemplate::parse(sources[i]);
    ASSERT_TRUE(t) << t.error().message;
    auto once = t->render(nlohmann::ordered_json::object());
    ASSERT_TRUE(once) << once.error().message;
    EXPECT_EQ(*once, expected[i]);
    const size_t before = mallinfo2().uordblks;
    for (int k = 0; k < 2000; ++k) ASSERT_TRUE(t->render(nlohmann::ordered_json::object()));
    const size_t after = mallinfo2().uordblks;
    // Leaking, each render kept a few KB of scopes (about 12 KB for the first template): megabytes in all.
    EXPECT_LT(after > before ? after - before : 0, size_t{256} << 10) << sources[i];
  }
}

TEST(TemplateLimits, StringGrowingOperationsRefuseHostileSizes) {
  const std::vector<std::pair<std::string, std::string>> hostile{
      {"{{ 'a' | center(10000000000) }}", "more than a template string may hold"},
      {"{{ 'a'.ljust(10000000000, 'xy') }}", "more than a template string may hold"},
      {"{{ ('a' * 1000000).replace('a', 'b' * 100) }}", "replace() of"},
      {"{{ 'abc'.replace('', 'y' * 30000000) }}", "replace() of"},
      {"{{ 'x' | indent(100000000) }}", "indent() of"},
      {"{{ ('x\\n' * 1000000) | indent('y' * 100, true) }}", "indent() of"},
      {"{% set s = 'a' * 60000000 %}{{ s ~ s }}", "'~' of"},
      {"{% set s = 'a' * 60000000 %}{{ s + s }}", "'+' of"},
      {"{{ '%.999999999f' % 1.0 }}", "format width or precision above 1048576"},
      {"{{ '%999999999d' % 1 }}", "format width or precision above 1048576"},
      {"{{ '{:.999999999f}'.format(1.0) }}", "format width or precision above 1048576"},
      {"{{ '{:>99999999999999999999}'.format('a') }}", "format width or precision above 1048576"},
  };
  for (const auto& [text, want] : hostile) {
    const std::string e = render_error(text);
    EXPECT_NE(e.find(want), std::string::npos) << text << " -> " << (e.empty() ? "(rendered)" : e);
  }
  // The same operations at ordinary sizes render as Python Jinja2 renders them.
  EXPECT_EQ(render_ok("{{ 'ab'.center(6, '*') }}|{{ 'ab' | center(5) }}|{{ 'x'.zfill(3) }}"), "**ab**|  ab |00x");
  EXPECT_EQ(render_ok("{{ 'aXbXc'.replace('X', '--', 1) }}|{{ 'a\\nb' | indent(2, true) }}"), "a--bXc|  a\n  b");
  EXPECT_EQ(render_ok("{{ '%5.2f' % 3.14159 }}|{{ '{:>4}'.format('a') }}|{{ 'a' ~ 1 }}"), " 3.14|   a|a1");
}

// A namespace that holds itself (found by template_fuzz: printing it recursed until the stack overflowed) is an
// error naming the cause, by str() and repr() alike; a namespace nested in another prints as Python Jinja2 prints it.
TEST(TemplateLimits, ANamespaceHoldingItselfIsAnErrorNotAStackOverflow) {
  for (const char* text : {"{% set ns = namespace(x=0) %}{% set ns.x = ns %}{{ ns.x }}",
                           "{% set ns = namespace(x=0) %}{% set ns.x = ns %}{{ [ns] }}",
                           "{% set ns = namespace(x=0) %}{% for i in range(6) %}{% set ns.x = ns %}{% endfor %}"
                           "{{ ns.x | string }}"}) {
    const std::string e = render_error(text);
    EXPECT_NE(e.find("nested too deeply to print"), std::string::npos) << text << " -> " << (e.empty() ? "(rendered)" : e);
  }
  EXPECT_EQ(render_ok("{% set a = namespace(v=1) %}{% set b = namespace(w=a) %}{{ b }}"),
            "<Namespace {'w': <Namespace {'v': 1}>}>");
}

}  // namespace
}  // namespace tern
