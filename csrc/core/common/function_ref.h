// A non-owning reference to a callable, for parameters called (or not) within the call that takes
// them: passing one stores two pointers and never allocates, where a std::function whose captures
// outgrow its small buffer allocates on every call. The callable must outlive the reference, so
// take one only as a function parameter and pass a lambda (or any callable) directly.
#pragma once

#include <memory>
#include <type_traits>
#include <utility>

namespace fused_dense::core {

template <class Signature>
class FunctionRef;

template <class R, class... Args>
class FunctionRef<R(Args...)> {
 public:
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, FunctionRef> &&
                                              std::is_invocable_r_v<R, F&, Args...>>>
  FunctionRef(F&& f)  // NOLINT(google-explicit-constructor): a lambda converts where a FunctionRef is taken
      : callable_(const_cast<void*>(static_cast<const void*>(std::addressof(f)))),
        call_([](void* callable, Args... args) -> R {
          return (*static_cast<std::remove_reference_t<F>*>(callable))(std::forward<Args>(args)...);
        }) {}

  R operator()(Args... args) const { return call_(callable_, std::forward<Args>(args)...); }

 private:
  void* callable_;
  R (*call_)(void*, Args...);
};

}  // namespace fused_dense::core
