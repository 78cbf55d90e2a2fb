#include <stdio.h>
#include "greet.h"

void greet(const char *who) {
    printf("Hello, %s!\n", who);
}
