"""The walls between jobs on one host: each attempt under a uid of its own (the uid pool,
what an attempt holds), the directories handed to that uid and taken back, what it
leaves behind, the start check, and a directory tree's seal no process can forge.

It may import ``edges`` alone (the processes a uid runs, NVML for the start check).
"""
