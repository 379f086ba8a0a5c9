"""tabular-mlp: a torch MLP classifier over numeric features, trained on generated data.

What ``fleet package`` needs to build a Bento of this family: the service's import path
and the files the Bento carries (training code stays out of it).
"""

SERVICE = "service:TabularClassifier"
BENTO_FILES = ("service.py", "model.py")
