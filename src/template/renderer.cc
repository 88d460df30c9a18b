#include "template/renderer.h"

#include <fmt/format.h>

#include "template/builtins.h"

namespace tern::jinja {

const Value* Scope::find(std::string_view name) const {
  for (const Scope* s = this; s; s = s->parent.get())
    for (const auto& [k, v] : s->vars)
      if (k == name) return &v;
  return nullptr;
}

void Scope::set(const std::string& name, Value value) {
  for (auto& [k, v] : vars)
    if (k == name) {
      v = std::move(value);
      return;
    }
  vars.emplace_back(name, std::move(value));
}

namespace {

ScopePtr child_scope(const ScopePtr& parent) {
  auto s = std::make_shared<Scope>();
  s->parent = parent;
  return s;
}

bool expr_uses_name(const Expr* e, std::string_view name);

bool body_uses_name(const Body& body, std::string_view name) {
  for (const auto& s : body) {
    for (const auto& e : s->exprs)
      if (expr_uses_name(e.get(), name)) return true;
    if (expr_uses_name(s->filter.get(), name)) return true;
    for (const auto& p : s->params)
      if (expr_uses_name(p.default_value.get(), name)) return true;
    if (s->kind == StmtKind::kMacro) continue;  // a nested macro has its own varargs/kwargs/caller
    for (const auto& b : s->bodies)
      if (body_uses_name(b, name)) return true;
  }
  return false;
}

bool expr_uses_name(const Expr* e, std::string_view name) {
  if (!e) return false;
  if (e->kind == ExprKind::kName && e->name == name) return true;
  for (const auto& a : e->args)
    if (expr_uses_name(a.get(), name)) return true;
  return expr_uses_name(e->star_args.get(), name) || expr_uses_name(e->star_kwargs.get(), name);
}

}  // namespace

void Renderer::count_step() {
  if (++steps_ > kMaxSteps) fail("template exceeded the step limit (runaway loop?)");
}

Renderer::~Renderer() {
  for (const ScopePtr& scope : closures_) {
    scope->vars.clear();
    scope->parent.reset();
  }
}

std::string Renderer::render(const Value& context) {
  auto globals = std::make_shared<Scope>();
  DictData g;
  builtin_add_globals(g);
  for (auto& [k, v] : g.entries) globals->set(k.str(), v);
  auto root = child_scope(globals);
  for (const auto& [k, v] : context.dict_data().entries) root->set(value_to_string(k), v);
  std::string out;
  exec_body(program_->body, root, out);
  return out;
}

Renderer::Flow Renderer::exec_body(const Body& body, const ScopePtr& scope, std::string& out) {
  for (const auto& s : body) {
    Flow f;
    try {
      f = exec(*s, scope, out);
    } catch (TemplateFailure& failure) {
      if (failure.line == 0) failure.line = s->line;
      throw;
    }
    if (f != Flow::kNormal) return f;
    if (out.size() > kMaxOutput) fail("template output exceeded the size limit");
  }
  return Flow::kNormal;
}

Renderer::Flow Renderer::exec(const Stmt& s, const ScopePtr& scope, std::string& out) {
  switch (s.kind) {
    case StmtKind::kText: out += s.text; return Flow::kNormal;
    case StmtKind::kOutput: out += value_to_string(eval(*s.exprs[0], scope)); return Flow::kNormal;
    case StmtKind::kIf:
      for (size_t i = 0; i < s.exprs.size(); ++i)
        if (eval(*s.exprs[i], scope).truthy()) return exec_body(s.bodies[i], scope, out);
      if (s.bodies.size() > s.exprs.size()) return exec_body(s.bodies.back(), scope, out);
      return Flow::kNormal;
    case StmtKind::kFor: return exec_for(s, scope, out);
    case StmtKind::kSet:
    case StmtKind::kSetBlock: exec_set(s, scope, out); return Flow::kNormal;
    case StmtKind::kMacro:
      scope->set(s.target.name, make_macro(s.target.name, &s.params, &s.bodies[0], scope));
      return Flow::kNormal;
    case StmtKind::kCallBlock: exec_call_block(s, scope, out); return Flow::kNormal;
    case StmtKind::kFilterBlock: exec_filter_block(s, scope, out); return Flow::kNormal;
    case StmtKind::kWith: {
      auto inner = child_scope(scope);
      for (size_t i = 0; i < s.exprs.size(); ++i) assign(s.with_targets[i], eval(*s.exprs[i], scope), inner);
      exec_body(s.bodies[0], inner, out);
      return Flow::kNormal;
    }
    case StmtKind::kGeneration: exec_body(s.bodies[0], child_scope(scope), out); return Flow::kNormal;
    case StmtKind::kBreak: return Flow::kBreak;
    case StmtKind::kContinue: return Flow::kContinue;
  }
  return Flow::kNormal;
}

Renderer::Flow Renderer::exec_for(const Stmt& s, const ScopePtr& scope, std::string& out) {
  const Value iterable = eval(*s.exprs[0], scope);
  std::vector<Value> items = iterate(iterable);
  if (s.exprs.size() > 1) {  // `for x in xs if cond`: filtered before loop.length is known
    std::vector<Value> kept;
    for (const Value& item : items) {
      auto probe = child_scope(scope);
      assign(s.target, item, probe);
      if (eval(*s.exprs[1], probe).truthy()) kept.push_back(item);
    }
    items = std::move(kept);
  }
  const auto n = static_cast<int64_t>(items.size());
  for (int64_t i = 0; i < n; ++i) {
    count_step();
    auto inner = child_scope(scope);
    auto loop = std::make_shared<ObjectData>();
    loop->type_name = "LoopContext";
    loop->attrs = {{"index", Value::integer(i + 1)},
                   {"index0", Value::integer(i)},
                   {"revindex", Value::integer(n - i)},
                   {"revindex0", Value::integer(n - i - 1)},
                   {"first", Value::boolean(i == 0)},
                   {"last", Value::boolean(i == n - 1)},
                   {"length", Value::integer(n)},
                   {"depth", Value::integer(1)},
                   {"depth0", Value::integer(0)},
                   {"previtem", i > 0 ? items[i - 1] : Value::undefined("there is no previous item")},
                   {"nextitem", i + 1 < n ? items[i + 1] : Value::undefined("there is no next item")}};
    loop->attrs.emplace_back("cycle", Value::callable("cycle", [i](CallArgs& args, Renderer&) {
                               if (args.positional.empty()) fail("no items for cycling given");
                               return args.positional[static_cast<size_t>(i) % args.positional.size()];
                             }));
    inner->set("loop", Value::object(loop));
    assign(s.target, items[i], inner);
    if (exec_body(s.bodies[0], inner, out) == Flow::kBreak) break;
  }
  if (n == 0) exec_body(s.bodies[1], scope, out);
  return Flow::kNormal;
}

void Renderer::assign(const Target& target, const Value& value, const ScopePtr& scope) {
  if (!target.attr.empty()) {
    const Value* ns = scope->find(target.name);
    if (!ns || !ns->is_object() || !ns->object_data()->is_namespace)
      fail("cannot assign attribute on non-namespace object");
    ns->object_data()->set(target.attr, value);
    return;
  }
  if (!target.is_tuple) {
    scope->set(target.name, value);
    return;
  }
  require_defined(value);
  const std::vector<Value> items = iterate(value);
  if (items.size() > target.items.size())
    fail(fmt::format("too many values to unpack (expected {})", target.items.size()));
  if (items.size() < target.items.size())
    fail(fmt::format("not enough values to unpack (expected {}, got {})", target.items.size(), items.size()));
  for (size_t i = 0; i < items.size(); ++i) assign(target.items[i], items[i], scope);
}

void Renderer::exec_set(const Stmt& s, const ScopePtr& scope, std::string&) {
  if (s.kind == StmtKind::kSet) {
    assign(s.target, eval(*s.exprs[0], scope), scope);
    return;
  }
  std::string body;
  exec_body(s.bodies[0], child_scope(scope), body);
  Value value = Value::string(std::move(body));
  if (s.filter) {
    auto tmp = child_scope(scope);
    tmp->set(kBodyVariable, value);
    value = eval(*s.filter, tmp);
  }
  assign(s.target, value, scope);
}

void Renderer::exec_filter_block(const Stmt& s, const ScopePtr& scope, std::string& out) {
  std::string body;
  exec_body(s.bodies[0], child_scope(scope), body);
  auto tmp = child_scope(scope);
  tmp->set(kBodyVariable, Value::string(std::move(body)));
  out += value_to_string(eval(*s.filter, tmp));
}

void Renderer::exec_call_block(const Stmt& s, const ScopePtr& scope, std::string& out) {
  const Expr& call = *s.exprs[0];
  const Value callee = eval(*call.args[0], scope);
  CallArgs args = eval_args(call, 1, scope);
  args.keyword.emplace_back("caller", make_macro("caller", &s.params, &s.bodies[0], scope));
  out += value_to_string(this->call(callee, args));
}

Value Renderer::make_macro(const std::string& name, const std::vector<MacroParam>* params, const Body* body,
                           const ScopePtr& closure) {
  const bool takes_varargs = body_uses_name(*body, "varargs");
  const bool takes_kwargs = body_uses_name(*body, "kwargs");
  const bool takes_caller = name != "caller" && body_uses_name(*body, "caller");
  auto program = program_;  // keeps the syntax tree alive as long as the macro value
  if (closures_.empty() || closures_.back() != closure) closures_.push_back(closure);
  return Value::callable(name, [=](CallArgs& args, Renderer& r) -> Value {
    (void)program;
    r.count_step();
    if (r.depth_ >= kMaxDepth) fail("maximum recursion depth exceeded");
    auto inner = child_scope(closure);
    if (args.positional.size() > params->size() && !takes_varargs)
      fail(fmt::format("macro '{}' takes not more than {} argument(s)", name, params->size()));
    std::vector<bool> bound(params->size(), false);
    for (size_t i = 0; i < params->size() && i < args.positional.size(); ++i) {
      inner->set((*params)[i].name, args.positional[i]);
      bound[i] = true;
    }
    auto kwargs = Value::dict();
    for (auto& [k, v] : args.keyword) {
      size_t i = 0;
      while (i < params->size() && (*params)[i].name != k) ++i;
      if (i < params->size()) {
        if (bound[i]) fail(fmt::format("macro '{}' got multiple values for argument '{}'", name, k));
        inner->set(k, v);
        bound[i] = true;
      } else if (k == "caller" && takes_caller) {
        inner->set("caller", v);
      } else if (takes_kwargs) {
        kwargs.dict_mut().set(Value::string(k), v);
      } else {
        fail(fmt::format("macro '{}' takes no keyword argument '{}'", name, k));
      }
    }
    for (size_t i = 0; i < params->size(); ++i) {
      if (bound[i]) continue;
      const MacroParam& p = (*params)[i];
      inner->set(p.name, p.default_value ? r.eval(*p.default_value, inner)
                                         : Value::undefined(fmt::format("parameter '{}' was not provided", p.name)));
    }
    if (takes_varargs) {
      std::vector<Value> extra;
      for (size_t i = params->size(); i < args.positional.size(); ++i) extra.push_back(args.positional[i]);
      inner->set("varargs", Value::list(std::move(extra), SeqKind::kTuple));
    }
    if (takes_kwargs) inner->set("kwargs", kwargs);
    std::string out;
    ++r.depth_;
    try {
      r.exec_body(*body, inner, out);
    } catch (...) {
      --r.depth_;
      throw;
    }
    --r.depth_;
    return Value::string(std::move(out));
  });
}

Value Renderer::call(const Value& callee, CallArgs& args) {
  if (callee.is_undefined()) require_defined(callee);
  if (!callee.is_callable()) fail(fmt::format("'{}' object is not callable", callee.type_name()));
  return callee.callable_data().fn(args, *this);
}

CallArgs Renderer::eval_args(const Expr& e, size_t first, const ScopePtr& scope) {
  CallArgs args;
  args.line = e.line;
  const size_t n_positional = e.args.size() - first - e.keywords.size();
  for (size_t i = 0; i < n_positional; ++i) args.positional.push_back(eval(*e.args[first + i], scope));
  for (size_t i = 0; i < e.keywords.size(); ++i)
    args.keyword.emplace_back(e.keywords[i], eval(*e.args[first + n_positional + i], scope));
  if (e.star_args)
    for (Value& v : iterate(eval(*e.star_args, scope))) args.positional.push_back(std::move(v));
  if (e.star_kwargs) {
    const Value kw = eval(*e.star_kwargs, scope);
    if (!kw.is_dict()) fail("argument after ** must be a mapping");
    for (const auto& [k, v] : kw.dict_data().entries) args.keyword.emplace_back(value_to_string(k), v);
  }
  return args;
}

Value Renderer::eval(const Expr& e, const ScopePtr& scope) {
  try {
    return eval_inner(e, scope);
  } catch (TemplateFailure& failure) {
    if (failure.line == 0) failure.line = e.line;
    throw;
  }
}

Value Renderer::eval_compare(const Expr& e, const ScopePtr& scope) {
  Value left = eval(*e.args[0], scope);
  for (size_t i = 0; i < e.ops.size(); ++i) {
    Value right = eval(*e.args[i + 1], scope);
    const std::string& op = e.ops[i];
    bool ok;
    if (op == "==") ok = value_equals(left, right);
    else if (op == "!=") ok = !value_equals(left, right);
    else if (op == "in") ok = contains_op(right, left);
    else if (op == "notin") ok = !contains_op(right, left);
    else {
      require_defined(left);
      require_defined(right);
      const int c = value_compare(left, right);
      ok = op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0;
    }
    if (!ok) return Value::boolean(false);
    left = std::move(right);
  }
  return Value::boolean(true);
}

Value Renderer::eval_inner(const Expr& e, const ScopePtr& scope) {
  switch (e.kind) {
    case ExprKind::kLiteral: return e.value;
    case ExprKind::kName: {
      const Value* v = scope->find(e.name);
      return v ? *v : Value::undefined(fmt::format("'{}' is undefined", e.name));
    }
    case ExprKind::kGetAttr: return get_attr(eval(*e.args[0], scope), e.name);
    case ExprKind::kGetItem: return get_item(eval(*e.args[0], scope), eval(*e.args[1], scope));
    case ExprKind::kSlice: {
      auto part = [&](size_t i) { return e.args[i] ? eval(*e.args[i], scope) : Value::none(); };
      return slice_value(eval(*e.args[0], scope), part(1), part(2), part(3));
    }
    case ExprKind::kCall: {
      const Value callee = eval(*e.args[0], scope);
      CallArgs args = eval_args(e, 1, scope);
      return call(callee, args);
    }
    case ExprKind::kFilter: {
      const Value input = eval(*e.args[0], scope);
      CallArgs args = eval_args(e, 1, scope);
      return builtin_filter(e.name, input, args, *this);
    }
    case ExprKind::kTest: {
      const Value input = eval(*e.args[0], scope);
      CallArgs args = eval_args(e, 1, scope);
      return Value::boolean(builtin_test(e.name, input, args, *this));
    }
    case ExprKind::kNot: return Value::boolean(!eval(*e.args[0], scope).truthy());
    case ExprKind::kNeg:
    case ExprKind::kPos: {
      const Value v = eval(*e.args[0], scope);
      require_defined(v);
      if (!v.is_number()) fail(fmt::format("bad operand type for unary {}: '{}'", e.kind == ExprKind::kNeg ? '-' : '+', v.type_name()));
      if (e.kind == ExprKind::kPos) return v.is_bool() ? Value::integer(v.as_int()) : v;
      if (v.is_float()) return Value::number(-v.as_double());
      if (v.as_int() == INT64_MIN) fail("integer overflow");
      return Value::integer(-v.as_int());
    }
    case ExprKind::kBinary: return binary_op(e.name, eval(*e.args[0], scope), eval(*e.args[1], scope));
    case ExprKind::kAnd: {
      Value left = eval(*e.args[0], scope);
      return left.truthy() ? eval(*e.args[1], scope) : left;
    }
    case ExprKind::kOr: {
      Value left = eval(*e.args[0], scope);
      return left.truthy() ? left : eval(*e.args[1], scope);
    }
    case ExprKind::kCompare: return eval_compare(e, scope);
    case ExprKind::kCondition:
      if (eval(*e.args[0], scope).truthy()) return eval(*e.args[1], scope);
      return e.args[2] ? eval(*e.args[2], scope) : Value::undefined("the inline if-expression evaluated to false and no else section was defined.");
    case ExprKind::kList:
    case ExprKind::kTuple: {
      std::vector<Value> items;
      for (const auto& a : e.args) items.push_back(eval(*a, scope));
      return Value::list(std::move(items), e.kind == ExprKind::kTuple ? SeqKind::kTuple : SeqKind::kList);
    }
    case ExprKind::kDict: {
      auto d = Value::dict();
      for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
        Value key = eval(*e.args[i], scope);
        if (key.is_list() && key.list_data().seq != SeqKind::kTuple) fail("unhashable type: 'list'");
        if (key.is_dict()) fail("unhashable type: 'dict'");
        d.dict_mut().set(key, eval(*e.args[i + 1], scope));
      }
      return d;
    }
  }
  return Value::undefined();
}

}  // namespace tern::jinja
