"""Tools beside the training core: each imports the core, the core never imports them."""
