CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER, amount REAL);
INSERT INTO customers VALUES (1, 'Ada'), (2, 'Linus'), (3, 'Grace');
INSERT INTO orders (customer_id, amount) VALUES
  (1, 10.0), (1, 12.5), (1, 9.0), (1, 11.0),
  (2, 250.0), (2, 15.0),
  (3, 99.0), (3, 40.0), (3, 20.0);
