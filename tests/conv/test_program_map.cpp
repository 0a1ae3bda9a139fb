#include <doctest/doctest.h>
// placeholder: being written
