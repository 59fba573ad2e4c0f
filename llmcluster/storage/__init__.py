"""The cluster's storage layout under one root (/storage on a cluster, ./storage by default). No torch here."""
