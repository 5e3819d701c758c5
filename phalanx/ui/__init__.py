"""``phalanx ui``: a live web dashboard of runs, served from the run DB and the store
(``app``: the web application; ``data``: what it shows; ``server``: serving it)."""
