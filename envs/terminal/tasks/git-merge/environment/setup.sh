set -e
git init -q -b main
git config user.name Dev && git config user.email dev@example.com
echo base > base.txt && git add base.txt && git commit -qm base
git checkout -qb feature && echo feat > feature.txt && git add feature.txt && git commit -qm 'Add feature'
git checkout -q main && echo more >> base.txt && git commit -qam 'Update base'
