"""Flower app: softmax regression on non-IID splits of scikit-learn's digits, balanced by lbbsp."""
