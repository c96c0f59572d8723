"""Store adapters. Each store's driver is imported only when that store is used."""
