mkdir -p cache/a/b cache/c
head -c 100 /dev/zero > cache/small.bin
head -c 1024 /dev/zero > cache/a/exact.bin
head -c 1025 /dev/zero > cache/a/over.bin
head -c 5000 /dev/zero > cache/a/b/big.bin
head -c 20 /dev/zero > cache/c/tiny.bin
head -c 9000 /dev/zero > cache/c/huge.log
