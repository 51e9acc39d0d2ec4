"""Memory reports: console tables now; HTML and plots later."""
