open("/tmp/pr3/tc/SIDE_EFFECT", "w").write("imported")
class Thing: pass
