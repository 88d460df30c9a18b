#include "template/template.h"
#include <gtest/gtest.h>
namespace tern { namespace {
TEST(Template, Smoke) {
  auto t = ChatTemplate::parse("{% for m in messages %}{{ m.role }}:{{ m['content']|upper }}\n{% endfor %}");
  ASSERT_TRUE(t) << t.error().message;
  auto r = t->render({{"messages", {{{"role", "user"}, {"content", "hi"}}}}});
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(*r, "user:HI\n");
}
}}
