#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
printf '#!/bin/bash\necho "Hello, ${NAME:-world}!"\n' > greet && chmod +x greet && NAME=Ann ./greet && ./greet
