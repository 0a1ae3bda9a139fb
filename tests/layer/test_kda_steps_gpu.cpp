#include <doctest/doctest.h>
// placeholder
