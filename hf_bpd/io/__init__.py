"""What is read and written for users: the packaged models and their heads, the Hub, exports."""
