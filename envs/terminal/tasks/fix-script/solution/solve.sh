#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
cat greet.sh
printf '#!/bin/bash\necho "Hello, $1!"\n' > greet.sh && chmod +x greet.sh && ./greet.sh Alice
