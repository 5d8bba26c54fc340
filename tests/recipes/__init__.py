"""The recipes of docs/recipes/, run whole: their examples under real servers."""
