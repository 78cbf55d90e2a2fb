#!/bin/bash
# The oracle policy's bash commands (policies.json), in order, in one shell.
cd /work
sqlite3 shop.db '.tables'
sqlite3 shop.db 'SELECT c.name FROM customers c JOIN orders o ON o.customer_id = c.id GROUP BY c.id ORDER BY SUM(o.amount) DESC LIMIT 1' > top.txt && cat top.txt
