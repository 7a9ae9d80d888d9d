"""Property-based tests (hypothesis) of the loop's cadences and training controls."""
