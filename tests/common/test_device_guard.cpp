// The device guard's bookkeeping with a fake device API: the target device is current inside
// the scope, the caller's comes back after it (by return or by throw), nothing is switched when
// the target is already current, and a failure to switch leaves the caller's device.
#include "common/device_guard.h"

#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace {
struct FakeDevices {
  static int current_device;
  static int fail_set_to;  // make_current of this device throws
  static std::vector<std::string> calls;
  static int current(const char*) {
    calls.push_back("get");
    return current_device;
  }
  static void make_current(int device, const char*) {
    calls.push_back("set " + std::to_string(device));
    if (device == fail_set_to) throw std::runtime_error("no such device");
    current_device = device;
  }
  static void restore(int device) noexcept {
    calls.push_back("restore " + std::to_string(device));
    current_device = device;
  }
  static void reset(int current) {
    current_device = current;
    fail_set_to = -1;
    calls.clear();
  }
};
int FakeDevices::current_device = 0;
int FakeDevices::fail_set_to = -1;
std::vector<std::string> FakeDevices::calls;

using Guard = kda::detail::BasicDeviceGuard<FakeDevices>;
}  // namespace

TEST_CASE("a guard makes its device current and gives the caller's back") {
  FakeDevices::reset(1);
  {
    const Guard g(0, "f");
    CHECK(FakeDevices::current_device == 0);
    CHECK(g.caller_device() == 1);
  }
  CHECK(FakeDevices::current_device == 1);
  CHECK(FakeDevices::calls == std::vector<std::string>{"get", "set 0", "restore 1"});
}

TEST_CASE("a guard on the device already current switches nothing") {
  FakeDevices::reset(2);
  { const Guard g(2, "f"); }
  CHECK(FakeDevices::current_device == 2);
  CHECK(FakeDevices::calls == std::vector<std::string>{"get"});
}

TEST_CASE("the caller's device comes back when the guarded work throws") {
  FakeDevices::reset(3);
  auto work = [] {
    const Guard g(1, "f");
    CHECK(FakeDevices::current_device == 1);
    throw std::runtime_error("step failed");
  };
  CHECK_THROWS_AS(work(), std::runtime_error);
  CHECK(FakeDevices::current_device == 3);
}

TEST_CASE("nested guards restore in order") {
  FakeDevices::reset(0);
  {
    const Guard outer(1, "f");
    {
      const Guard inner(2, "g");
      CHECK(FakeDevices::current_device == 2);
    }
    CHECK(FakeDevices::current_device == 1);
  }
  CHECK(FakeDevices::current_device == 0);
}

TEST_CASE("a device that cannot be made current throws and leaves the caller's device") {
  FakeDevices::reset(0);
  FakeDevices::fail_set_to = 5;
  CHECK_THROWS_AS(Guard(5, "f"), std::runtime_error);
  CHECK(FakeDevices::current_device == 0);
  CHECK(FakeDevices::calls == std::vector<std::string>{"get", "set 5"});
}
