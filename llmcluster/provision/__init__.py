"""provision: the cluster spec rendered as an Ansible project that installs the stack level by level.

No torch import here (the head node provisions before any ML stack exists).
"""
