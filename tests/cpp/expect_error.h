// tests/cpp/expect_error.h
// \brief EXPECT_ERROR_MENTIONS(statement, fragments...): the statement throws flashkit::Error and
// its message contains every fragment. Shared by the bad-input tests of every entry point.
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "flashkit/error.h"

namespace flashkit::test {

// Runs `call` and expects a flashkit::Error whose message contains every fragment.
template <typename Call>
void expect_error(Call&& call, std::initializer_list<const char*> fragments) {
  try {
    call();
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const char* fragment : fragments) {
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "message: " << message << "\nmissing: " << fragment;
    }
    return;
  }
  ADD_FAILURE() << "no flashkit::Error was thrown";
}

#define EXPECT_ERROR_MENTIONS(statement, ...)                          \
  do {                                                                 \
    SCOPED_TRACE(#statement);                                          \
    ::flashkit::test::expect_error([&] { statement; }, {__VA_ARGS__}); \
  } while (0)

}  // namespace flashkit::test
