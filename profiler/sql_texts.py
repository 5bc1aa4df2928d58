"""Embedded texts of the ``sql-template`` workload: a shop's database schema, the system
text every request starts with, and question templates whose slots take a few values.

Templated SQL is the traffic the store drafter is for (SuffixDecoding's AgenticSQL): an
application asks the same questions with other values, so what a model writes for one ask
is, but for the values, what it wrote for an earlier ask of the same template, which is
not in the prompt (prompt lookup cannot copy it). The shared system text is a prefix the
store reuses, so each ask prefills its question alone.
"""
from __future__ import annotations

from profiler.prompt_texts import chat_prompt

SQL_SYSTEM = """You write SQLite queries for a shop's database. Its tables:

CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, email TEXT, city TEXT, country TEXT, joined_on DATE);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL, stock INTEGER);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id), ordered_on DATE, status TEXT);
CREATE TABLE order_items (order_id INTEGER REFERENCES orders(id), product_id INTEGER REFERENCES products(id), quantity INTEGER, unit_price REAL);

Answer with one SQL query in a ```sql block, then one sentence on what it does.
"""

# Each slot's values; an ask of a template takes the i-th value of each (rotated by the
# template's index, so two templates do not pair the same values).
SQL_SLOTS = {
    "city": ("Paris", "Berlin", "Madrid", "Lisbon", "Vienna", "Dublin"),
    "country": ("France", "Germany", "Spain", "Portugal", "Austria", "Ireland"),
    "year": ("2019", "2020", "2021", "2022", "2023", "2024"),
    "category": ("books", "toys", "garden", "kitchen", "music", "sports"),
    "status": ("shipped", "delivered", "paid", "returned", "cancelled", "pending"),
    "count": ("3", "5", "10", "2", "20", "4"),
    "price": ("50", "100", "25", "200", "75", "10"),
    "product": ("Desk Lamp", "Coffee Grinder", "Yoga Mat", "Chess Set", "Water Bottle", "Notebook"),
}

SQL_TEMPLATES = (
    "How many orders did customers from {city} place in {year}?",
    "List the names and emails of customers who live in {city} and joined after {year}.",
    "What is the total revenue from products in the '{category}' category for orders with status '{status}'?",
    "Which {count} products in the '{category}' category have the lowest stock?",
    "Show the average order value per month in {year} for customers from {country}.",
    "Find the customers from {country} who have placed more than {count} orders.",
    "List the products in the '{category}' category that cost more than {price} dollars, most expensive first.",
    "How many units of '{product}' were sold in {year}?",
)
SQL_VALUES_PER_SLOT = len(SQL_SLOTS["city"])


def sql_question(template: int, ask: int) -> str:
    """The ``ask``-th question of a template (0 <= ask < ``SQL_VALUES_PER_SLOT``)."""
    i = (ask + template) % SQL_VALUES_PER_SLOT
    return SQL_TEMPLATES[template].format(**{slot: values[i] for slot, values in SQL_SLOTS.items()})


def sql_prompt(question: str) -> str:
    """The schema's system text, then the question as a chat turn."""
    return SQL_SYSTEM + "\n" + chat_prompt(question)
