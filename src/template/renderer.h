// Tree-walking evaluator with Jinja2's scoping: each for-loop iteration, macro call, call/filter/set block and
// `with` gets a child scope, so `set` inside them does not leak, while namespace() objects are shared.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "template/ast.h"
#include "template/value.h"

namespace tern::jinja {

struct Scope {
  std::shared_ptr<Scope> parent;
  std::vector<std::pair<std::string, Value>> vars;
  const Value* find(std::string_view name) const;
  void set(const std::string& name, Value value);
};
using ScopePtr = std::shared_ptr<Scope>;

class Renderer {
 public:
  // Limits against runaway templates: loop iterations plus macro calls, macro nesting, output size.
  static constexpr int64_t kMaxSteps = 2'000'000;
  static constexpr int kMaxDepth = 256;
  static constexpr size_t kMaxOutput = 256u << 20;

  explicit Renderer(std::shared_ptr<const Program> program) : program_(std::move(program)) {}
  // Breaks the reference cycles macros make (a scope holds the macro, the macro holds the scope) so that every
  // scope and value of the render is freed.
  ~Renderer();
  // Throws TemplateFailure on runtime errors.
  std::string render(const Value& context);
  Value call(const Value& callee, CallArgs& args);
  void count_step();

 private:
  enum class Flow { kNormal, kBreak, kContinue };
  Flow exec_body(const Body& body, const ScopePtr& scope, std::string& out);
  Flow exec(const Stmt& s, const ScopePtr& scope, std::string& out);
  Flow exec_for(const Stmt& s, const ScopePtr& scope, std::string& out);
  void exec_set(const Stmt& s, const ScopePtr& scope, std::string& out);
  void exec_call_block(const Stmt& s, const ScopePtr& scope, std::string& out);
  void exec_filter_block(const Stmt& s, const ScopePtr& scope, std::string& out);
  void assign(const Target& target, const Value& value, const ScopePtr& scope);
  Value make_macro(const std::string& name, const std::vector<MacroParam>* params, const Body* body,
                   const ScopePtr& closure);
  Value eval(const Expr& e, const ScopePtr& scope);
  Value eval_inner(const Expr& e, const ScopePtr& scope);
  Value eval_compare(const Expr& e, const ScopePtr& scope);
  CallArgs eval_args(const Expr& e, size_t first, const ScopePtr& scope);

  std::shared_ptr<const Program> program_;
  int64_t steps_ = 0;
  int depth_ = 0;
  std::vector<ScopePtr> closures_;  // every scope a macro captured
};

}  // namespace tern::jinja
