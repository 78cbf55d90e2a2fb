set -e
git init -q -b main
git config user.name Dev && git config user.email dev@example.com
printf 'retries = 3\ntimeout = 30\n' > config.ini && git add config.ini && git commit -qm 'Add config'
sed -i 's/timeout = 30/timeout = 0/' config.ini && git commit -qam 'Break config'
echo '# app' > README.md && git add README.md && git commit -qm 'Add readme'
