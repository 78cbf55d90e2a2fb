void greet(const char *who);
