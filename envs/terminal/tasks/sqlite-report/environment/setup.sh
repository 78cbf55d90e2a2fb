sqlite3 shop.db < schema.sql && rm schema.sql
