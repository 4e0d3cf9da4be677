"""The on-disk format of prefix KV for the impress_flexgen runtime."""
